"""Decode kernels (GPU in interpret mode, TPU in TPU interpret mode) against the float32 reference.

Each case is one batch holding every length class: 0, 1, block_size - 1, block_size,
block_size + 1, partition - 1, partition, partition + 1 and a long context spanning several
partitions; pools start all-NaN (stale slots) and block tables are random permutations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    HEADS,
    PAGES_PER_BLOCK,
    assert_matches,
    decode_case,
    fresh_rng,
    matrix,
    on_backend,
    partition_tokens,
    tpu_interpret,
)
from pagedjax.pallas_kernels import paged_attention, paged_attention_reference
from pagedjax.pallas_kernels.selection import resolve_name


def decode_lengths(block_size: int) -> list[int]:
    p = partition_tokens(block_size)
    return [0, 1, block_size - 1, block_size, block_size + 1, p - 1, p, p + 1, 3 * p + 5]


def check_against_reference(case, out, *, kernel, dtype, record_error):
    ref = paged_attention_reference(*case.as_float32().args(), scale=case.scale)
    err = assert_matches(case, out, ref, kernel=kernel, dtype=dtype, record_error=record_error)
    empty = np.asarray(case.context_lens) == 0
    assert not np.asarray(out[empty], np.float32).any(), "a length-0 sequence must give zeros"
    return err


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("block_size,head_dim,ratio,dtype", matrix())
def test_decode_kernel_matches_reference(
    request, record_error, backend, block_size, head_dim, ratio, dtype
):
    num_heads, num_kv_heads = HEADS[ratio]
    case = decode_case(
        fresh_rng(request),
        decode_lengths(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=jnp.dtype(dtype),
    )
    ctx, kw = on_backend(backend)
    with ctx:
        out = paged_attention(
            *case.args(),
            scale=case.scale,
            pages_per_block=PAGES_PER_BLOCK,
            partition_size=partition_tokens(block_size),
            **kw,
        )
        out.block_until_ready()
    check_against_reference(
        case, out, kernel=f"decode-{backend}", dtype=dtype, record_error=record_error
    )


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_decode_kernel_default_knobs(request, record_error, backend):
    """Default tiling: GPU splits contexts to fill the device, TPU does not split."""
    case = decode_case(
        fresh_rng(request),
        [0, 1, 17, 150],
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        head_dim=64,
        dtype=jnp.float32,
    )
    ctx, kw = on_backend(backend)
    with ctx:
        out = paged_attention(*case.args(), scale=case.scale, **kw)
    check_against_reference(
        case, out, kernel=f"decode-{backend}", dtype="float32", record_error=record_error
    )


def test_tpu_decode_cuts_a_large_block_table_into_chunks(request, record_error):
    """A table over max_table_entries is scalar-prefetched a chunk of sequences at a time."""
    case = decode_case(
        fresh_rng(request),
        [5, 40, 0, 17],
        num_heads=4,
        num_kv_heads=1,
        block_size=8,
        head_dim=64,
        dtype=jnp.float32,
    )
    table_cols = case.block_tables.shape[1]
    with tpu_interpret():
        out = paged_attention(
            *case.args(),
            scale=case.scale,
            backend="tpu",
            pages_per_block=2,
            max_table_entries=2 * table_cols,
        )
    check_against_reference(
        case, out, kernel="decode-tpu", dtype="float32", record_error=record_error
    )


def test_tpu_decode_on_two_cores_has_no_races(request, record_error):
    """All grid axes are "parallel": run on two simulated TensorCores with the race detector."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    case = decode_case(
        fresh_rng(request),
        [0, 1, 17, 40],
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        head_dim=64,
        dtype=jnp.float32,
    )
    with tpu_interpret(num_cores_or_threads=2, detect_races=True):
        out = paged_attention(
            *case.args(), scale=case.scale, backend="tpu", pages_per_block=1, partition_size=32
        )
        out.block_until_ready()
    assert not interpret_pallas_call.races.races_found
    check_against_reference(
        case, out, kernel="decode-tpu", dtype="float32", record_error=record_error
    )


# Production shapes (Llama-3-8B-like, 32k contexts) lowered for the real targets on this CPU:
# Triton IR for "cuda", Mosaic for "tpu". Nothing is allocated.
LOWER_SHAPES = [
    pytest.param(32, 8, 128, 16, jnp.bfloat16, id="h32-kv8-d128-bs16-bf16"),
    pytest.param(40, 8, 64, 8, jnp.float32, id="h40-kv8-d64-bs8-f32"),
    pytest.param(8, 8, 128, 32, jnp.bfloat16, id="h8-kv8-d128-bs32-bf16"),
]


@pytest.mark.parametrize("platform,marker", [("cuda", "triton"), ("tpu", "tpu_custom_call")])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", LOWER_SHAPES)
def test_decode_kernel_lowers_for_device(
    platform, marker, num_heads, num_kv_heads, head_dim, block_size, dtype
):
    num_seqs, max_blocks, num_blocks = 32, 32768 // block_size + 3, 4099  # odd sizes
    sds = jax.ShapeDtypeStruct
    args = (
        sds((num_seqs, num_heads, head_dim), dtype),
        sds((num_kv_heads, num_blocks, block_size, head_dim), dtype),
        sds((num_kv_heads, num_blocks, block_size, head_dim), dtype),
        sds((num_seqs, max_blocks), jnp.int32),
        sds((num_seqs,), jnp.int32),
    )
    backend = "gpu" if platform == "cuda" else "tpu"
    lowered = paged_attention.trace(*args, scale=0.1, backend=backend).lower(
        lowering_platforms=(platform,)
    )
    assert marker in lowered.as_text()


def test_decode_validation_errors():
    q = jnp.zeros((2, 6, 64))
    pages = jnp.zeros((4, 8, 16, 64))
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(q, pages, pages, table, lens, scale=1.0)
    q = jnp.zeros((2, 8, 64))
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(q, pages, pages, table, lens, scale=1.0, backend="cuda")
    with pytest.raises(ValueError, match="partition_size"):
        paged_attention(
            q,
            pages,
            pages,
            table,
            lens,
            scale=1.0,
            backend="gpu",
            partition_size=24,
            interpret=True,
        )
    odd = jnp.zeros((4, 8, 16, 80))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_attention(
            jnp.zeros((2, 8, 80)), odd, odd, table, lens, scale=1.0, backend="gpu", interpret=True
        )


def test_auto_backend_falls_back_to_reference_for_shapes_the_gpu_kernel_cannot_tile():
    gpu = dict(platform="gpu", block_size=16)
    assert resolve_name("auto", head_dim=128, **gpu) == "triton"
    assert resolve_name("auto", head_dim=80, **gpu) == "reference"
    assert resolve_name("gpu", head_dim=80, **gpu) == "triton"  # explicit: the kernel raises
    assert resolve_name("auto", platform="cpu") == "native"
