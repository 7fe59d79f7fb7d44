"""Ragged kernels (GPU in interpret mode, TPU in TPU interpret mode) against the float32 reference.

Each case is one packed batch mixing a whole prompt, a later chunk of a chunked prefill, a
prefix-cache hit with a few new tokens, decodes of every length class, an empty slot, and NaN
padding rows that must come back zero. Pools start all-NaN; block tables are random permutations.
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
    fresh_rng,
    matrix,
    on_backend,
    partition_tokens,
    ragged_case,
    tpu_interpret,
)
from pagedjax.pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)


def mixed_batch(block_size: int) -> list[tuple[int, int]]:
    """(context_len, query_len) per sequence."""
    bs, p = block_size, partition_tokens(block_size)
    return [
        (2 * bs + 3, 2 * bs + 3),  # a whole prompt
        (p + 1, bs - 1),  # a later chunk of a chunked prefill
        (3 * p + 5, 3),  # prefix-cache hit: long cached prefix, 3 new tokens
        (0, 0),  # an empty slot
        (1, 1),  # decodes at every length class
        (bs, 1),
        (bs + 1, 1),
        (p - 1, 1),
        (p, 1),
        (bs - 1, bs - 1),  # a short prompt
    ]


def check_against_reference(case, out, *, kernel, dtype, record_error):
    ref = ragged_paged_attention_reference(
        *case.as_float32().args(), scale=case.scale, max_query_len=case.max_query_len
    )
    assert_matches(case, out, ref, kernel=kernel, dtype=dtype, record_error=record_error)
    used = int(case.query_start_loc[-1])
    assert not np.asarray(out[used:], np.float32).any(), "padding rows must come back zero"


def run(case, backend, **knobs):
    ctx, kw = on_backend(backend)
    with ctx:
        out = ragged_paged_attention(
            *case.args(), scale=case.scale, max_query_len=case.max_query_len, **kw, **knobs
        )
        return out.block_until_ready()


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("block_size,head_dim,ratio,dtype", matrix())
def test_ragged_kernel_matches_reference_on_a_mixed_batch(
    request, record_error, backend, block_size, head_dim, ratio, dtype
):
    num_heads, num_kv_heads = HEADS[ratio]
    case = ragged_case(
        fresh_rng(request),
        mixed_batch(block_size),
        pad_rows=3,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=jnp.dtype(dtype),
    )
    # TPU: 16-row tiles, so tiles hold rows of several sequences and sequences span tiles.
    knobs = {"block_q": 16} if backend == "tpu" else {}
    out = run(case, backend, pages_per_block=PAGES_PER_BLOCK, **knobs)
    check_against_reference(
        case, out, kernel=f"ragged-{backend}", dtype=dtype, record_error=record_error
    )


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_ragged_decode_only_batch_goes_through_the_decode_kernel(request, record_error, backend):
    """max_query_len == 1: one row per sequence (or none), padding rows after them."""
    case = ragged_case(
        fresh_rng(request),
        [(0, 0), (1, 1), (17, 1), (0, 0), (70, 1)],
        pad_rows=2,
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        head_dim=64,
        dtype=jnp.float32,
    )
    assert case.max_query_len == 1
    out = run(case, backend, pages_per_block=PAGES_PER_BLOCK)
    check_against_reference(
        case, out, kernel=f"ragged-{backend}", dtype="float32", record_error=record_error
    )


def test_tpu_ragged_on_two_cores_has_no_races(request, record_error):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    case = ragged_case(
        fresh_rng(request),
        [(40, 20), (17, 1), (0, 0), (5, 5)],
        pad_rows=3,
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        head_dim=64,
        dtype=jnp.float32,
    )
    with tpu_interpret(num_cores_or_threads=2, detect_races=True):
        out = ragged_paged_attention(
            *case.args(),
            scale=case.scale,
            max_query_len=case.max_query_len,
            backend="tpu",
            block_q=16,
            pages_per_block=1,
        )
        out.block_until_ready()
    assert not interpret_pallas_call.races.races_found
    check_against_reference(
        case, out, kernel="ragged-tpu", dtype="float32", record_error=record_error
    )


@pytest.mark.parametrize("platform,marker", [("cuda", "triton"), ("tpu", "tpu_custom_call")])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        pytest.param(32, 8, 128, 16, jnp.bfloat16, id="h32-kv8-d128-bs16-bf16"),
        pytest.param(40, 8, 64, 8, jnp.float32, id="h40-kv8-d64-bs8-f32"),
    ],
)
def test_ragged_kernel_lowers_for_device(
    platform, marker, num_heads, num_kv_heads, head_dim, block_size, dtype
):
    """A ~2k-token mixed batch of 63 sequences over 32k-token tables, lowered for the device."""
    num_tokens, num_seqs, max_blocks, num_blocks = 2045, 63, 32768 // block_size + 3, 4099
    sds = jax.ShapeDtypeStruct
    args = (
        sds((num_tokens, num_heads, head_dim), dtype),
        sds((num_kv_heads, num_blocks, block_size, head_dim), dtype),
        sds((num_kv_heads, num_blocks, block_size, head_dim), dtype),
        sds((num_seqs, max_blocks), jnp.int32),
        sds((num_seqs,), jnp.int32),
        sds((num_seqs + 1,), jnp.int32),
    )
    backend = "gpu" if platform == "cuda" else "tpu"
    lowered = ragged_paged_attention.trace(
        *args, scale=0.1, max_query_len=512, backend=backend
    ).lower(lowering_platforms=(platform,))
    assert marker in lowered.as_text()


def test_ragged_validation_errors():
    q = jnp.zeros((5, 8, 64))
    pages = jnp.zeros((2, 8, 16, 64))
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    qsl = jnp.array([0, 2, 5], jnp.int32)
    with pytest.raises(ValueError, match="query_start_loc shape"):
        ragged_paged_attention(q, pages, pages, table, lens, qsl[:2], scale=1.0)
    with pytest.raises(ValueError, match="max_query_len"):
        ragged_paged_attention(q, pages, pages, table, lens, qsl, scale=1.0, max_query_len=6)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention(
            q, pages, pages, table, lens, qsl, scale=1.0, backend="gpu", interpret=True, block_q=3
        )
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention(
            q, pages, pages, table, lens, qsl, scale=1.0, backend="tpu", block_q=12
        )
