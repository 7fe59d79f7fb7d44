"""GPU attention for packed (ragged) batches over a paged KV pool (Pallas, Triton lowering).

One program per (sequence, KV head, tile of ``block_q`` of its query rows). The tile's rows times
the GQA group's heads are the matmul rows. Keys are walked from the first token up to the causal
bound of the tile's last row; each row sees keys ``0 ..= context_len - query_len + j``, or only
the last ``sliding_window`` of them (key blocks before the window of the tile's first row are
skipped). Rows are read and written with masks, so a tile never touches another sequence's rows.
An 8-bit pool's per-token scales are loaded with its pages and multiply the logits' columns (K)
and the probabilities (V).
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
    next_pow2,
    online_softmax_step,
    require_block_scale_rows,
    softmax_finish,
    softmax_init,
    window_operand,
    window_start,
    with_scale_refs,
)
from . import lowering


def _ragged_kernel(
    lens_ref,  # i32[num_seqs]: context lengths (new tokens included)
    qsl_ref,  # i32[num_seqs + 1]: query_start_loc
    win_ref,  # i32[1]: sliding window (<= 0: none); read only when `windowed`
    bt_ref,  # i32[table_cols]: this sequence's block table
    q_ref,  # [padded_tokens, group_p, head_dim]: this KV head's query heads, all rows
    k_ref,  # [num_blocks, block_size, head_dim]: this KV head's pool
    v_ref,
    ks_ref,  # f32[num_blocks, block_size]: K scales of an 8-bit pool (None for a float pool)
    vs_ref,  # f32[num_blocks, block_size]: V scales
    o_ref,  # [padded_tokens, group_p, head_dim]
    *,
    scale: float,
    pages_per_block: int,
    block_q: int,
    group: int,
    windowed: bool,
    soft_cap: float | None,
    precision,
):
    seq, tile = pl.program_id(0), pl.program_id(2)
    _, block_size, head_dim = k_ref.shape
    block_k = pages_per_block * block_size
    group_p = q_ref.shape[1]
    rows = block_q * group_p
    ctx = lens_ref[seq]
    q_start, q_end = qsl_ref[seq], qsl_ref[seq + 1]
    q_len = q_end - q_start
    j0 = tile * block_q
    live = jnp.clip(q_len - j0, 0, block_q)  # this tile's rows that belong to the sequence
    row0 = jnp.where(live > 0, q_start + j0, 0)
    pos0 = ctx - q_len + j0  # position of the tile's first row
    kv_end = jnp.where(live > 0, jnp.clip(pos0 + live, 0, ctx), 0)

    q = q_ref[pl.ds(row0, block_q)].reshape(rows, head_dim)  # row r = (query j, head g)
    q_pos = pos0 + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group_p)
    # The tile's first row sees keys from lo on (later rows fewer): key blocks before it skipped.
    window = win_ref[0] if windowed else None
    lo = window_start(jnp.maximum(pos0, 0), window) if windowed else None

    def step(i, carry):
        ids = bt_ref[pl.ds(i * pages_per_block, pages_per_block)]
        page = i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        live = page * block_size < ctx
        if windowed:
            live &= (page + 1) * block_size > lo
        ids = jnp.where(live, ids, 0)
        k = k_ref[ids].reshape(block_k, head_dim)
        v = v_ref[ids].reshape(block_k, head_dim)
        col = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        seen = (col <= q_pos) & (col < ctx)
        if windowed:
            seen &= col >= window_start(q_pos, window)
        k_scale = v_scale = None
        if ks_ref is not None:  # 8-bit pool: scale the logits' columns and the probabilities
            k_scale = ks_ref[ids].reshape(1, block_k)
            used_col = (col < ctx) & (col >= lo) if windowed else col < ctx
            v_scale = jnp.where(used_col, vs_ref[ids].reshape(1, block_k), 0.0)
            v = v.astype(q.dtype)
        s = attention_logits(q, k, scale, soft_cap, k_scale, precision)
        s = jnp.where(seen, s, -jnp.inf)
        key = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        used = key < ctx
        if windowed:
            used &= key >= lo
        v = jnp.where(used, v, jnp.zeros_like(v))  # stale slots may be NaN
        return online_softmax_step(s, v, *carry, v_scale=v_scale, precision=precision)

    first_step = jax.lax.div(lo, block_k) if windowed else 0
    _, den, acc = jax.lax.fori_loop(
        first_step, cdiv(kv_end, block_k), step, softmax_init(rows, head_dim)
    )
    out = softmax_finish(den, acc).astype(o_ref.dtype).reshape(block_q, group_p, head_dim)
    shape = (block_q, group_p, head_dim)
    mine = (jax.lax.broadcasted_iota(jnp.int32, shape, 0) < live) & (
        jax.lax.broadcasted_iota(jnp.int32, shape, 1) < group
    )
    lowering.masked_store(o_ref.at[pl.ds(row0, block_q)], out, mine)


def _query_tile(block_q: int | None, group_p: int, max_query_len: int) -> int:
    """Query rows per tile: a power of two whose tile of block_q * group_p rows is >= 16."""
    if block_q is None:
        block_q = max(1, 64 // group_p)
        block_q = min(block_q, max(next_pow2(max_query_len), cdiv(16, group_p)))
    if block_q < 1 or block_q & (block_q - 1) or block_q * group_p < 16:
        raise ValueError(
            f"block_q={block_q} must be a power of two with block_q * {group_p} (padded GQA "
            "group) >= 16"
        )
    return block_q


def triton_prefill(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    kv: m.PagedKV,
    md: m.AttentionMetadata,
    opts: m.AttentionOptions,
    *,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]; rows owned by no sequence are unspecified
    g = wrapper.geometry(q, kv, md)
    require_block_scale_rows(kv)
    max_query_len = md.max_q(g.num_rows)
    group_p = next_pow2(g.group)
    block_q = _query_tile(block_q, group_p, max_query_len)
    if pages_per_block is None:
        pages_per_block = max(1, 64 // g.block_size)
    block_k = pages_per_block * g.block_size
    lowering.check_gpu_shapes(block_size=g.block_size, head_dim=g.head_dim, block_k=block_k)

    table = wrapper.whole_blocks_table(md, g, pages_per_block)
    lens = wrapper.clipped_lens(md, g)
    # Pad rows by one tile so a tile starting at any real row stays in bounds.
    padded = g.num_rows + block_q
    qg = wrapper.grouped_queries(q, g, pad_rows=block_q, group_to=group_p)

    kernel = functools.partial(
        _ragged_kernel,
        scale=opts.scale,
        pages_per_block=pages_per_block,
        block_q=block_q,
        group=g.group,
        windowed=opts.sliding_window is not None,
        soft_cap=opts.soft_cap,
        precision=lowering.dot_precision(q.dtype),
    )
    head_dim, num_blocks, block_size = g.head_dim, g.num_blocks, g.block_size
    rows_spec = pl.BlockSpec((padded, None, group_p, head_dim), lambda s, h, t: (0, h, 0, 0))
    pool_spec = pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda s, h, t: (h, 0, 0, 0))
    scales_spec = pl.BlockSpec((None, num_blocks, block_size), lambda s, h, t: (h, 0, 0))
    out = pl.pallas_call(
        with_scale_refs(kernel, 7, kv.quantized),
        grid=(g.num_seqs, g.num_kv_heads, cdiv(max_query_len, block_q)),
        in_specs=[
            pl.BlockSpec((g.num_seqs,), lambda s, h, t: (0,)),
            pl.BlockSpec((g.num_seqs + 1,), lambda s, h, t: (0,)),
            pl.BlockSpec((1,), lambda s, h, t: (0,)),
            pl.BlockSpec((None, table.shape[1]), lambda s, h, t: (s, 0)),
            rows_spec,
            pool_spec,
            pool_spec,
            *[scales_spec for _ in kv.scales],
        ],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=lowering.compiler_params(
            num_warps=num_warps, num_stages=num_stages, interpret=interpret
        ),
        interpret=interpret,
        name=f"paged_ragged_bs{block_size}_bq{block_q}_g{g.group}",
    )(
        lens,
        md.query_start_loc.astype(jnp.int32),
        window_operand(opts.sliding_window),
        table,
        qg,
        kv.k_pages,
        kv.v_pages,
        *kv.scales,
    )
    return out[: g.num_rows, :, : g.group].reshape(g.num_rows, g.num_heads, head_dim)
