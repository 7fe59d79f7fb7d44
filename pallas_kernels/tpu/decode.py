"""TPU decode attention over a paged KV pool (Pallas, Mosaic TPU).

One program per (sequence, KV head, partition); the query heads of a GQA group are the matmul
rows. Context lengths and block table are scalar-prefetched into SMEM; pages are copied from the
HBM pool into a double-buffered VMEM tile (next block's DMAs in flight while this one computes).
Partitions are merged afterwards. Logits AND value rows past the length (or before the sliding
window) are masked; key blocks wholly before the window are skipped. An 8-bit pool's per-token
scales are copied with its pages (each page's whole scale row, pool_layout.py) and multiply the
logits' columns (K) and the probabilities (V); the pages are cast to the query's dtype (exact).

SMEM is small, so the batch is cut into chunks whose block table fits ``max_table_entries``, one
``pallas_call`` per chunk, instead of prefetching a huge table whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import metadata as m
from .. import wrapper
from .._common import (
    attention_logits,
    cdiv,
    decode_tiling,
    merge_partitions,
    online_softmax_step,
    pad_block_tables,
    softmax_finish,
    softmax_init,
    window_operand,
    window_start,
    with_scale_refs,
)
from . import common as tpu

MAX_TABLE_ENTRIES = 32768  # i32 entries of block table prefetched per call (128 KiB of SMEM)


def _decode_kernel(
    # scalar prefetch (SMEM)
    lens_ref,  # i32[chunk_seqs]
    win_ref,  # i32[1]: sliding window (<= 0: none); read only when `windowed`
    table_ref,  # i32[chunk_seqs * table_cols], the chunk's block table, flattened
    # inputs
    q_ref,  # [group, head_dim] (VMEM block)
    k_hbm,  # [num_kv_heads, num_blocks, block_size, head_dim] (HBM, copied by hand)
    v_hbm,
    ks_hbm,  # f32[num_kv_heads, num_blocks, width]: an 8-bit pool's K scale rows (HBM), or None
    vs_hbm,
    # outputs
    o_ref,  # [group, head_dim]: normalised partial output
    m_ref,  # f32[group, 1]: running max (-inf if the partition saw no key)
    l_ref,  # f32[group, 1]: softmax denominator relative to m
    # scratch
    k_buf,  # [2, block_k, head_dim]
    v_buf,
    sems,  # DMA[2 (k, v), 2 (slot)]
    ks_buf=None,  # f32[2, pages_per_block, width]: an 8-bit pool's K scale rows (or absent)
    vs_buf=None,
    *,
    scale: float,
    pages_per_block: int,
    pages_per_partition: int,
    table_cols: int,
    windowed: bool,
    soft_cap: float | None,
):
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size = k_hbm.shape[2]
    rows, head_dim = q_ref.shape
    block_k = pages_per_block * block_size
    length = lens_ref[seq]
    first_page = split * pages_per_partition
    first_token = first_page * block_size
    num_tokens = jnp.clip(length - first_token, 0, pages_per_partition * block_size)
    # Keys [lo, length) are seen (the query sits at length - 1); key blocks before lo are skipped.
    lo = window_start(length - 1, win_ref[0]) if windowed else None

    def fetch(i, slot):
        pages = [first_page + i * pages_per_block + j for j in range(pages_per_block)]
        ids = [
            tpu.live_page_id(table_ref, seq * table_cols + page, page, length, block_size, lo)
            for page in pages
        ]
        scales = None if ks_hbm is None else (ks_hbm, vs_hbm, ks_buf, vs_buf)
        return tpu.page_copies(
            k_hbm, v_hbm, k_buf, v_buf, sems, head=head, page_ids=ids, slot=slot, scales=scales
        )

    def seen(pos):
        ok = pos < length
        return ok & (pos >= lo) if windowed else ok

    q = q_ref[...]

    def compute(i, slot, carry):
        token0 = first_token + i * block_k
        col = token0 + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        v = v_buf[slot]
        k_scale = v_scale = None
        if ks_buf is not None:  # 8-bit pool: scale the logits' columns and the probabilities
            key = token0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            k_scale = tpu.block_scales(ks_buf[slot], block_size)  # f32[1, block_k]
            v_scale = tpu.block_scales(vs_buf[slot], block_size)
            v_scale = jnp.where(seen(key), v_scale, 0.0)  # stale scales may be NaN
            v = v.astype(q.dtype)
        s = attention_logits(q, k_buf[slot], scale, soft_cap, k_scale)
        s = jnp.where(seen(col), s, -jnp.inf)
        row = token0 + jax.lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
        v = jnp.where(seen(row), v, jnp.zeros_like(v))  # stale slots may be NaN
        return online_softmax_step(s, v, *carry, v_scale=v_scale)

    m, den, acc = tpu.paged_flash_loop(
        first_step=jax.lax.div(jnp.maximum(lo - first_token, 0), block_k) if windowed else 0,
        num_steps=cdiv(num_tokens, block_k),
        fetch=fetch,
        compute=compute,
        init=softmax_init(rows, head_dim),
    )
    o_ref[...] = softmax_finish(den, acc).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = den


def _decode_call(
    q,
    k_pages,
    v_pages,
    scales,  # () or an 8-bit pool's (k_scales, v_scales)
    lens,
    window,
    table,
    *,
    scale,
    tiling,
    out_dtype,
    interpret,
    soft_cap,
):
    """One pallas_call over a chunk of sequences. q [chunk, Hkv, group, D], table [chunk, cols]."""
    num_seqs, num_kv_heads, group, head_dim = q.shape
    block_size = k_pages.shape[2]
    num_splits = tiling.num_splits
    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        pages_per_block=tiling.pages_per_block,
        pages_per_partition=tiling.pages_per_partition,
        table_cols=table.shape[1],
        windowed=window is not None,
        soft_cap=soft_cap,
    )
    partial_shape = (num_splits, num_seqs, num_kv_heads, group)
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda s, h, p, *_: (s, h, 0, 0))
    o_spec = pl.BlockSpec((None, None, None, group, head_dim), lambda s, h, p, *_: (p, s, h, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, group, 1), lambda s, h, p, *_: (p, s, h, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scratch = tpu.kv_buffers(
        pages_per_block=tiling.pages_per_block,
        block_size=block_size,
        head_dim=head_dim,
        dtype=k_pages.dtype,
    )
    if scales:
        width = scales[0].shape[2]
        scratch += tpu.scale_buffers(pages_per_block=tiling.pages_per_block, width=width)
    return pl.pallas_call(
        with_scale_refs(kernel, 6, bool(scales)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_seqs, num_kv_heads, num_splits),
            in_specs=[q_spec, any_spec, any_spec, *[any_spec for _ in scales]],
            out_specs=[o_spec, ml_spec, ml_spec],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), out_dtype),
            jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
            jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
        ],
        compiler_params=tpu.compiler_params(3),
        interpret=interpret,
        name=f"paged_decode_tpu_bs{block_size}_ppb{tiling.pages_per_block}_g{group}",
    )(lens, window_operand(window), table.reshape(-1), q, k_pages, v_pages, *scales)


def tpu_decode(
    q: jax.Array,  # [num_seqs, num_heads, head_dim]
    kv: m.PagedKV,
    md: m.AttentionMetadata,
    opts: m.AttentionOptions,
    *,
    pages_per_block: int | None = None,
    partition_size: int | None = None,
    max_table_entries: int = MAX_TABLE_ENTRIES,
    interpret: bool = False,
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    interpret = tpu.interpret_params(interpret)
    g = wrapper.geometry(q, kv, md)
    if pages_per_block is None:
        pages_per_block = max(1, 256 // g.block_size)
    # A TensorCore runs its grid in sequence: split contexts only when asked to.
    tiling = decode_tiling(
        block_size=g.block_size,
        max_blocks=g.max_blocks,
        pages_per_block=pages_per_block,
        partition_size=partition_size,
        default_splits=1,
    )
    if tiling.padded_max_blocks > max_table_entries:
        raise ValueError(
            f"one sequence's block table ({tiling.padded_max_blocks} entries) exceeds "
            f"max_table_entries={max_table_entries}"
        )
    table = pad_block_tables(md.block_tables.astype(jnp.int32), tiling.padded_max_blocks)
    lens = wrapper.clipped_lens(md, g)
    qg = wrapper.grouped_queries(q, g)
    out_dtype = q.dtype if tiling.num_splits == 1 else jnp.float32

    chunk = max(1, max_table_entries // tiling.padded_max_blocks)
    parts = [
        _decode_call(
            qg[lo : lo + chunk],
            kv.k_pages,
            kv.v_pages,
            kv.scales,
            lens[lo : lo + chunk],
            opts.sliding_window,
            table[lo : lo + chunk],
            scale=opts.scale,
            soft_cap=opts.soft_cap,
            tiling=tiling,
            out_dtype=out_dtype,
            interpret=interpret,
        )
        for lo in range(0, g.num_rows, chunk)
    ]
    o, m, den = (
        jnp.concatenate(xs, axis=1) if len(parts) > 1 else xs[0] for xs in zip(*parts, strict=True)
    )
    out = merge_partitions(o, m[..., 0], den[..., 0])
    return out.reshape(g.num_rows, g.num_heads, g.head_dim).astype(q.dtype)
