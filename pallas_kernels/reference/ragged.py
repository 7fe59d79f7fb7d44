"""The oracle for ragged attention: pure jnp, float32, its work following the real query rows.

Packed query rows are cut into tiles of ``tile_rows`` consecutive rows, walked one tile at a time
(``lax.map``); each tile takes one of three branches (``lax.switch``):

- no row of any sequence (padding): zeros, no work;
- live rows of a single sequence (the inside of a prefill): that sequence's context is gathered
  once and the tile's rows attend it as one matmul;
- live rows of several sequences (decodes, boundaries between sequences): each row gathers its
  own sequence's context.

So a step costs about (prefill tiles + decode rows) x the block table's span, instead of
num_seqs x max_query_len x that span for a layout padded per sequence. Each tile only touches
its own rows, so shapes are static and nothing depends on how the batch is mixed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._common import cap_logits, cdiv, window_start
from ..metadata import AttentionMetadata, AttentionOptions, PagedKV
from .decode import gather_context

TILE_ROWS = 16  # query rows per tile; prefill tiles are [16 x group] x context matmuls

EMPTY, ONE_SEQUENCE, PER_ROW = 0, 1, 2  # the tile branches


def reference_prefill(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    kv: PagedKV,
    md: AttentionMetadata,
    opts: AttentionOptions,
    *,
    tile_rows: int = TILE_ROWS,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]; rows of no sequence are zero
    """Float32 attention of packed query rows over their paged contexts (the contract of
    ``AttentionBackend.ragged``); rows at or past ``max_query_len`` in their sequence are zero."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = md.num_seqs
    max_q = md.max_q(num_tokens)
    num_kv_heads = kv.k_pages.shape[0]
    group = num_heads // num_kv_heads
    num_tiles = cdiv(num_tokens, tile_rows)
    rows = num_tiles * tile_rows
    qsl = md.query_start_loc.astype(jnp.int32)
    lens = md.context_lens.astype(jnp.int32)

    # Per packed row: its sequence (the last one starting at or before it), position, liveness.
    n = jnp.arange(rows, dtype=jnp.int32)
    seq = jnp.searchsorted(qsl, n, side="right", method="compare_all") - 1  # no while loop
    seq = jnp.clip(seq, 0, num_seqs - 1)
    j = n - qsl[seq]
    live = (n < jnp.minimum(qsl[-1], num_tokens)) & (j < max_q)
    pos = lens[seq] - (qsl[seq + 1] - qsl[seq]) + j  # i32[rows]
    ctx = jnp.where(live, lens[seq], 0)  # a dead row sees no key

    qf = jnp.pad(q.astype(jnp.float32), ((0, rows - num_tokens), (0, 0), (0, 0)))
    qf = jnp.where(live[:, None, None], qf, 0)  # padding rows may hold NaN
    qf = qf.reshape(num_tiles, tile_rows, num_kv_heads, group, head_dim)

    tiled = lambda x: x.reshape(num_tiles, tile_rows)
    first = jnp.min(jnp.where(tiled(live), tiled(seq), num_seqs), axis=1)  # i32[num_tiles]
    last = jnp.max(jnp.where(tiled(live), tiled(seq), -1), axis=1)
    branch = jnp.where(last < 0, EMPTY, jnp.where(first == last, ONE_SEQUENCE, PER_ROW))

    attend = functools.partial(_attend_tile, kv=kv, block_tables=md.block_tables, opts=opts)
    out = jax.lax.map(
        attend,
        (branch, jnp.clip(first, 0, num_seqs - 1), qf, tiled(seq), tiled(pos), tiled(ctx)),
    )  # [num_tiles, tile_rows, num_kv_heads, group, head_dim]
    return out.reshape(rows, num_heads, head_dim)[:num_tokens].astype(q.dtype)


def _attend_tile(tile, *, kv: PagedKV, block_tables, opts: AttentionOptions):
    branch, tile_seq, q, seq, pos, ctx = tile  # q f32[tile_rows, Hkv, group, D]; rest i32[rows]
    span = block_tables.shape[1] * kv.block_size
    t = jnp.arange(span, dtype=jnp.int32)
    seen = (t[None, :] < ctx[:, None]) & (t[None, :] <= pos[:, None])  # [tile_rows, span]
    if opts.windowed:
        seen &= t[None, :] >= window_start(pos, opts.sliding_window)[:, None]

    def softmax_pv(s, v, mask):  # s [rows, Hkv, group, span]; v [rows or 1, Hkv, span, D]
        s = jnp.where(mask[:, None, None, :], cap_logits(s * opts.scale, opts.soft_cap), -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom == 0, 1, denom)  # a row that sees no key gives zeros
        if v.shape[0] == 1:
            return jnp.einsum("rkgt,ktd->rkgd", p, v[0])
        return jnp.einsum("rkgt,rktd->rkgd", p, v)

    def empty():
        return jnp.zeros_like(q)

    def one_sequence():  # the tile's live rows share one context, gathered once
        table = block_tables[tile_seq][None]
        k = gather_context(kv.k_pages, table, kv.k_scales)  # [1, Hkv, span, D]
        k = k.astype(jnp.float32)
        v = gather_context(kv.v_pages, table, kv.v_scales).astype(jnp.float32)
        v = jnp.where(seen.any(axis=0)[None, None, :, None], v, 0)  # stale slots may be NaN
        s = jnp.einsum("rkgd,ktd->rkgt", q, k[0])
        return softmax_pv(s, v, seen)

    def per_row():  # each row gathers its own sequence's context
        table = block_tables[seq]
        k = gather_context(kv.k_pages, table, kv.k_scales)  # [rows, Hkv, span, D]
        k = k.astype(jnp.float32)
        v = gather_context(kv.v_pages, table, kv.v_scales).astype(jnp.float32)
        v = jnp.where(seen[:, None, :, None], v, 0)
        s = jnp.einsum("rkgd,rktd->rkgt", q, k)
        return softmax_pv(s, v, seen)

    return jax.lax.switch(branch, (empty, one_sequence, per_row))
