"""The TPU's pool layout (pallas_kernels/pool_layout.py) and its KV write (tpu/write.py), in
interpret mode: pages padded to 128 lanes of head_dim and 8-bit scale rows padded to 128
columns give the unpadded pool's attention, the padding never read (NaN there changes nothing),
and the TPU's per-head scatter writes what the reference write writes. (That the padded layout
and the scatter compile for a TPU, with no copy of the pool, is tests/aot/'s.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    decode_case,
    fresh_rng,
    numpy_attention,
    query_positions,
    ragged_case,
    rel_err,
)
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import kv_pool_bytes_per_block, kv_pool_shapes
from pagedjax.pallas_kernels import (
    AttentionMetadata,
    AttentionOptions,
    PagedKV,
    ReferenceBackend,
    TpuBackend,
    write_kv_reference,
)
from pagedjax.pallas_kernels.pool_layout import PoolLayout, pool_layout
from pagedjax.pallas_kernels.tpu.write import write_kv_rows

SHAPE = dict(num_heads=4, num_kv_heads=2, block_size=8, head_dim=32, dtype=jnp.float32)
SEQS = [(21, 13), (9, 1), (0, 0), (30, 2)]  # (context_len, query_len)
TOL = 2e-5


def test_tpu_layout_pads_head_dim_and_scale_rows_to_whole_lanes():
    assert pool_layout("tpu", 16, 64) == pool_layout("tpu", 32, 128)
    assert pool_layout("tpu", 16, 64).head_dim == 128
    assert pool_layout("tpu", 16, 64).scale_width == 128
    assert pool_layout("tpu", 256, 256) == PoolLayout(256, 256, 8)
    assert pool_layout("cpu", 16, 64) == pool_layout("gpu", 16, 64) == PoolLayout(64, 16)
    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 576,
            "intermediate_size": 64,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 2,
            "vocab_size": 32,
        }
    )
    tpu = kv_pool_shapes(config, 10, 16, jnp.int8, platform="tpu")
    # the scales' rows (2 layers x 10 blocks) rounded up to a multiple of 8: spare rows
    assert [s.shape for s in tpu] == [(3, 20, 16, 128)] * 2 + [(3, 24, 128)] * 2
    cpu = kv_pool_shapes(config, 10, 16, jnp.int8, platform="cpu")
    assert [s.shape for s in cpu] == [(3, 20, 16, 64)] * 2 + [(3, 20, 16)] * 2
    # What the pool's memory budget counts is what the platform stores.
    assert kv_pool_bytes_per_block(config, 16, jnp.int8, "tpu") == 2 * 2 * 3 * (16 * 128 + 512)
    assert kv_pool_bytes_per_block(config, 16, jnp.int8, "cpu") == 2 * 2 * 3 * (16 * 64 + 64)


def _rows(rng, n, num_kv_heads, head_dim):
    return jnp.asarray(rng.standard_normal((n, num_kv_heads, head_dim)), jnp.float32)


@pytest.mark.parametrize("kv_dtype", [None, jnp.int8])
def test_tpu_write_matches_the_reference_write(request, kv_dtype):
    """Same pages and scales as write_kv_reference, padding rows dropped, into a pool padded
    to 128 lanes (its padding columns zero) and into an unpadded one."""
    rng = fresh_rng(request)
    heads, blocks, bs, hd = 2, 6, 8, 32
    slots = jnp.asarray([5, -1, 0, 13, -3, blocks * bs - 1, 20], jnp.int32)
    k_new, v_new = _rows(rng, 7, heads, hd), _rows(rng, 7, heads, hd)
    for width in (bs, 128):
        dtype = kv_dtype or jnp.float32
        stored = hd if width == bs else 128
        pages = jnp.asarray(rng.standard_normal((heads, blocks, bs, stored)), dtype)
        pool = [pages, pages + 1]
        if kv_dtype is not None:
            rows = blocks + (width != bs) * 2  # a TPU pool's scales have spare rows
            scales = jnp.asarray(rng.random((heads, rows, width)), jnp.float32)
            pool += [scales, scales + 1]
        want = write_kv_reference(*pool[:2], k_new, v_new, slots, *pool[2:])
        got = jax.jit(write_kv_rows)(*pool[:2], k_new, v_new, slots, *pool[2:])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        written = np.asarray(got[0], np.float32)[:, 0, 5]  # slot 5: block 0, offset 5
        assert not written[:, hd:].any(), "a row's padding columns are written as zeros"


def _padded(x, axis_len, fill):
    pad = [(0, 0)] * (x.ndim - 1) + [(0, axis_len - x.shape[-1])]
    return jnp.pad(x, pad, constant_values=fill)


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.int8])
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_padded_tpu_pool_gives_the_unpadded_attention(request, layout, kv_dtype):
    """The model's K/V written by the TPU backend into a pool padded as a TPU stores it
    (head_dim 32 -> 128; 8-bit scale rows 8 -> 128 columns, NaN past the block), then its
    attention through ``attend``: the float64 oracle's, on q of the model's head_dim."""
    rng = fresh_rng(request)
    if layout == "decode":
        case = decode_case(rng, [c for c, _ in SEQS], **SHAPE)
    else:
        case = ragged_case(rng, SEQS, pad_rows=2, **SHAPE)
    heads, blocks, bs, hd = case.k_pages.shape
    layout = pool_layout("tpu", bs, hd)
    slots = np.flatnonzero(np.isfinite(np.asarray(case.k_pages)[0, :, :, 0]).reshape(-1))

    def rows(pages):  # the written slots' rows, [n, heads, head_dim]
        return jnp.asarray(np.asarray(pages).reshape(heads, -1, hd)[:, slots].swapaxes(0, 1))

    stale = jnp.full((heads, blocks, bs, layout.head_dim), jnp.nan, jnp.float32)
    pool = [stale.astype(kv_dtype), stale.astype(kv_dtype)]
    if kv_dtype == jnp.int8:
        pool = [jnp.zeros_like(p) for p in pool]
        spare = layout.scale_rows(blocks + 1)  # spare rows, as a TPU pool's may have
        pool += [jnp.full((heads, spare, layout.scale_width), jnp.nan, jnp.float32)] * 2
    backend = TpuBackend(interpret=True, block_q=8)
    kv = backend.write_kv(
        PagedKV(*pool), rows(case.k_pages), rows(case.v_pages), jnp.asarray(slots, jnp.int32)
    )
    if kv_dtype == jnp.int8:  # the oracle reads what the pool holds: the dequantized rows
        deq = [np.asarray(p, np.float64)[..., :hd] for p in (kv.k_pages, kv.v_pages)]
        scales = [np.asarray(s, np.float64)[:, :blocks, :bs, None] for s in kv.scales]
        case.k_pages, case.v_pages = deq[0] * scales[0], deq[1] * scales[1]
    max_q = None if layout == "decode" else 16
    md = AttentionMetadata(
        case.block_tables, case.context_lens, case.query_start_loc, max_query_len=max_q
    )
    opts = AttentionOptions(case.scale)
    out = jax.jit(backend.attend)(case.q, kv, md, opts)
    assert out.shape == case.q.shape
    want = numpy_attention(case, window=None, soft_cap=None)
    assert rel_err(out, want) <= TOL
    idle = np.setdiff1d(np.arange(case.q.shape[0]), [r for r, _, _ in query_positions(case)])
    assert not np.asarray(out)[idle].any()
    ref = jax.jit(ReferenceBackend().attend)(case.q, kv, md, opts)  # reads the layout too
    assert rel_err(ref, want) <= TOL
