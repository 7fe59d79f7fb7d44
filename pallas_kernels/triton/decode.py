"""GPU decode attention over a paged KV pool (Pallas, Triton lowering: ``lowering.py``).

One program per (sequence, KV head, partition). The query heads of a GQA group are the matmul
rows (padded to 16, Triton's smallest dot). Each program walks its partition's pages
``pages_per_block`` at a time with an online softmax and writes its normalised output with the
running max and denominator; partitions are merged afterwards (vLLM's paged-attention v2).
Logits AND value rows past the sequence's length (or before its sliding window) are masked: stale
slots may hold NaN. Key blocks wholly before the window are skipped. An 8-bit pool's pages are
cast to the query's dtype (exact) and their per-token scales, loaded with the pages, multiply the
logits' columns (K) and the probabilities (V).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import metadata as m
from .. import wrapper
from .._common import (
    attention_logits,
    cdiv,
    decode_tiling,
    merge_partitions,
    next_pow2,
    online_softmax_step,
    pad_block_tables,
    require_block_scale_rows,
    softmax_finish,
    softmax_init,
    window_operand,
    window_start,
    with_scale_refs,
)
from . import lowering

# Enough programs to fill an H100/H200 (132 SMs) a few times over before splitting contexts.
TARGET_PROGRAMS = 512


def _decode_kernel(
    lens_ref,  # i32[1]: this sequence's context length
    win_ref,  # i32[1]: sliding window (<= 0: none); read only when `windowed`
    bt_ref,  # i32[pages_per_partition]: this partition's slice of the block table
    q_ref,  # [group_p, head_dim]: the GQA group's query heads (rows past `group` are zero)
    k_ref,  # [num_blocks, block_size, head_dim]: this KV head's pool
    v_ref,  # [num_blocks, block_size, head_dim]
    ks_ref,  # f32[num_blocks, block_size]: K scales of an 8-bit pool (None for a float pool)
    vs_ref,  # f32[num_blocks, block_size]: V scales
    o_ref,  # [group_p, head_dim]: normalised partial output
    m_ref,  # f32[group_p]: running max of the logits (-inf if the partition saw no key)
    l_ref,  # f32[group_p]: softmax denominator relative to m
    *,
    scale: float,
    pages_per_block: int,
    group: int,
    windowed: bool,
    soft_cap: float | None,
    precision,
):
    split = pl.program_id(2)
    pages_per_partition = bt_ref.shape[0]
    _, block_size, head_dim = k_ref.shape
    rows = q_ref.shape[0]
    block_k = pages_per_block * block_size
    length = lens_ref[0]
    first_page = split * pages_per_partition
    first_token = first_page * block_size
    num_tokens = jnp.clip(length - first_token, 0, pages_per_partition * block_size)
    # Keys [lo, length) are seen (the query sits at length - 1); key blocks before lo are skipped.
    lo = window_start(length - 1, win_ref[0]) if windowed else 0
    first_step = jax.lax.div(jnp.maximum(lo - first_token, 0), block_k) if windowed else 0
    q = q_ref[...]

    def seen(first, last):  # keys first..last (inclusive) overlap [lo, length)
        ok = first < length
        return ok & (last >= lo) if windowed else ok

    def step(i, carry):
        ids = bt_ref[pl.ds(i * pages_per_block, pages_per_block)]  # i32[pages_per_block]
        page = first_page + i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        # Never follow the ids of pages past the end or wholly before the window.
        ids = jnp.where(seen(page * block_size, page * block_size + block_size - 1), ids, 0)
        k = k_ref[ids].reshape(block_k, head_dim)
        v = v_ref[ids].reshape(block_k, head_dim)
        token0 = first_token + i * block_k
        col = token0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        k_scale = v_scale = None
        if ks_ref is not None:  # 8-bit pool: scale the logits' columns and the probabilities
            k_scale = ks_ref[ids].reshape(1, block_k)
            v_scale = jnp.where(seen(col, col), vs_ref[ids].reshape(1, block_k), 0.0)
            v = v.astype(q.dtype)
        s = attention_logits(q, k, scale, soft_cap, k_scale, precision)
        s = jnp.where(seen(col, col), s, -jnp.inf)
        row = token0 + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        v = jnp.where(seen(row, row), v, jnp.zeros_like(v))  # stale slots may be NaN
        return online_softmax_step(s, v, *carry, v_scale=v_scale, precision=precision)

    m, den, acc = jax.lax.fori_loop(
        first_step, cdiv(num_tokens, block_k), step, softmax_init(rows, head_dim)
    )
    out = softmax_finish(den, acc).astype(o_ref.dtype)
    # Only the group's real rows are stored: the padded ones are never read back.
    real = jax.lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) < group
    lowering.masked_store(o_ref, out, real)
    m_ref[...] = m.reshape(rows)
    l_ref[...] = den.reshape(rows)


def _decode_specs(pool_shape: tuple, group_p: int, ppp: int, num_scales: int):
    """BlockSpecs over the grid (seq s, kv head h, partition p): inputs (lens, window, table,
    q group, K and V pools, scales) and outputs (partial out, running max, denominator)."""
    _, num_blocks, block_size, head_dim = pool_shape
    pool_spec = pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda s, h, p: (h, 0, 0, 0))
    scales_spec = pl.BlockSpec((None, num_blocks, block_size), lambda s, h, p: (h, 0, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda s, h, p: (s,)),
        pl.BlockSpec((1,), lambda s, h, p: (0,)),
        pl.BlockSpec((None, ppp), lambda s, h, p: (s, p)),
        pl.BlockSpec((None, None, group_p, head_dim), lambda s, h, p: (s, h, 0, 0)),
        pool_spec,
        pool_spec,
        *[scales_spec for _ in range(num_scales)],
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, group_p, head_dim), lambda s, h, p: (p, s, h, 0, 0)),
        pl.BlockSpec((None, None, None, group_p), lambda s, h, p: (p, s, h, 0)),
        pl.BlockSpec((None, None, None, group_p), lambda s, h, p: (p, s, h, 0)),
    ]
    return in_specs, out_specs


def triton_decode(
    q: jax.Array,  # [num_seqs, num_heads, head_dim]
    kv: m.PagedKV,
    md: m.AttentionMetadata,
    opts: m.AttentionOptions,
    *,
    pages_per_block: int | None = None,
    partition_size: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    """Build the grid and BlockSpecs, run the kernel, merge the partitions."""
    g = wrapper.geometry(q, kv, md)
    require_block_scale_rows(kv)
    group_p = max(16, next_pow2(g.group))
    if pages_per_block is None:
        pages_per_block = max(1, 128 // g.block_size)
    lowering.check_gpu_shapes(
        block_size=g.block_size, head_dim=g.head_dim, block_k=pages_per_block * g.block_size
    )
    tiling = decode_tiling(
        block_size=g.block_size,
        max_blocks=g.max_blocks,
        pages_per_block=pages_per_block,
        partition_size=partition_size,
        default_splits=cdiv(TARGET_PROGRAMS, max(1, g.num_rows * g.num_kv_heads)),
    )
    ppp, num_splits = tiling.pages_per_partition, tiling.num_splits
    block_tables = pad_block_tables(md.block_tables.astype(jnp.int32), tiling.padded_max_blocks)
    lens = wrapper.clipped_lens(md, g)
    qg = wrapper.grouped_queries(q, g, group_to=group_p)

    out_dtype = q.dtype if num_splits == 1 else jnp.float32
    partial_shape = (num_splits, g.num_rows, g.num_kv_heads, group_p)
    kernel = functools.partial(
        _decode_kernel,
        scale=opts.scale,
        pages_per_block=pages_per_block,
        group=g.group,
        windowed=opts.sliding_window is not None,
        soft_cap=opts.soft_cap,
        precision=lowering.dot_precision(q.dtype),
    )
    in_specs, out_specs = _decode_specs(kv.k_pages.shape, group_p, ppp, len(kv.scales))
    o, m, den = pl.pallas_call(
        with_scale_refs(kernel, 6, kv.quantized),
        grid=(g.num_rows, g.num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, g.head_dim), out_dtype),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        compiler_params=lowering.compiler_params(
            num_warps=num_warps, num_stages=num_stages, interpret=interpret
        ),
        interpret=interpret,
        name=f"paged_decode_bs{g.block_size}_ppb{pages_per_block}_g{g.group}",
    )(
        lens,
        window_operand(opts.sliding_window),
        block_tables,
        qg,
        kv.k_pages,
        kv.v_pages,
        *kv.scales,
    )
    out = merge_partitions(o[..., : g.group, :], m[..., : g.group], den[..., : g.group])
    return out.reshape(g.num_rows, g.num_heads, g.head_dim).astype(q.dtype)
