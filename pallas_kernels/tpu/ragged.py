"""TPU attention for packed (ragged) batches over a paged KV pool (Pallas, Mosaic TPU).

One program per (KV head, tile of ``block_q`` packed query rows), so every output block belongs
to exactly one program. A tile loops over the sequences owning its rows (the first one is
scalar-prefetched with the lengths and ``query_start_loc``); for each it copies the sequence's
block-table row from HBM into SMEM (the whole table is never prefetched), then walks the keys up
to the causal bound of its last row with double-buffered page copies, masking rows of other
sequences, keys past each row's position, and value rows past the length (stale slots may be NaN).
An 8-bit pool's per-token scales are copied with its pages and multiply the logits' columns (K)
and the probabilities (V).
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
    next_pow2,
    online_softmax_step,
    softmax_finish,
    softmax_init,
    window_operand,
    window_start,
    with_scale_refs,
)
from . import common as tpu


def _ragged_kernel(
    # scalar prefetch (SMEM)
    lens_ref,  # i32[num_seqs]: context lengths (new tokens included)
    qsl_ref,  # i32[num_seqs + 1]: query_start_loc
    first_seq_ref,  # i32[num_tiles]: the first sequence owning a row of each tile
    win_ref,  # i32[1]: sliding window (<= 0: none); read only when `windowed`
    # inputs
    q_ref,  # [group, block_q, head_dim]: this KV head's query heads for the tile's rows
    table_hbm,  # i32[num_seqs, table_cols] (HBM)
    k_hbm,  # [num_kv_heads, num_blocks, block_size, head_dim] (HBM)
    v_hbm,
    ks_hbm,  # f32[num_kv_heads, num_blocks, width]: an 8-bit pool's K scale rows (HBM), or None
    vs_hbm,
    # outputs
    o_ref,  # [group, block_q, head_dim]
    # scratch
    table_smem,  # i32[table_cols]: the current sequence's block-table row
    table_sem,  # DMA
    k_buf,  # [2, block_k, head_dim]
    v_buf,
    sems,  # DMA[2 (k, v), 2 (slot)]
    ks_buf=None,  # f32[2, pages_per_block, width]: an 8-bit pool's K scale rows (or absent)
    vs_buf=None,
    *,
    scale: float,
    pages_per_block: int,
    num_seqs: int,
    windowed: bool,
    soft_cap: float | None,
):
    head, tile = pl.program_id(0), pl.program_id(1)
    group, block_q, head_dim = q_ref.shape
    block_size = k_hbm.shape[2]
    block_k = pages_per_block * block_size
    rows = group * block_q
    t0 = tile * block_q
    q = q_ref[...].reshape(rows, head_dim)  # row r = (head r // block_q, token t0 + r % block_q)
    token = t0 + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), block_q)
    token_out = t0 + jax.lax.broadcasted_iota(jnp.int32, o_ref.shape, 1)
    o_ref[...] = jnp.zeros_like(o_ref)  # rows owned by no sequence stay zero

    def more(seq):
        return (seq < num_seqs) & (qsl_ref[seq] < t0 + block_q)

    def attend(seq):
        ctx = lens_ref[seq]
        q_start, q_end = qsl_ref[seq], qsl_ref[seq + 1]
        q_len = q_end - q_start
        hi = jnp.minimum(q_end, t0 + block_q)  # one past the tile's last row of this sequence
        first = jnp.maximum(q_start, t0)  # the tile's first row of this sequence
        live = hi > first
        kv_end = jnp.where(live, jnp.clip(ctx - q_len + (hi - q_start), 0, ctx), 0)
        # Keys before the window of the first row are seen by none: their blocks are skipped.
        window = win_ref[0] if windowed else None
        first_pos = jnp.maximum(ctx - q_len + (first - q_start), 0)
        lo = window_start(first_pos, window) if windowed else None

        @pl.when(live)
        def _():
            copy = pltpu.make_async_copy(table_hbm.at[seq], table_smem, table_sem)
            copy.start()
            copy.wait()

        q_pos = ctx - q_len + (token - q_start)  # [rows, 1]

        def fetch(i, slot):
            pages = [i * pages_per_block + j for j in range(pages_per_block)]
            ids = [tpu.live_page_id(table_smem, p, p, ctx, block_size, lo) for p in pages]
            scales = None if ks_hbm is None else (ks_hbm, vs_hbm, ks_buf, vs_buf)
            return tpu.page_copies(
                k_hbm, v_hbm, k_buf, v_buf, sems, head=head, page_ids=ids, slot=slot, scales=scales
            )

        def compute(i, slot, carry):
            col = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
            seen = (col <= q_pos) & (col < ctx)
            if windowed:
                seen &= col >= window_start(q_pos, window)
            v = v_buf[slot]
            k_scale = v_scale = None
            if ks_buf is not None:  # 8-bit pool: scale the logits' columns and the probabilities
                key = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
                used = key < ctx
                if windowed:
                    used &= key >= lo
                k_scale = tpu.block_scales(ks_buf[slot], block_size)  # f32[1, block_k]
                v_scale = tpu.block_scales(vs_buf[slot], block_size)
                v_scale = jnp.where(used, v_scale, 0.0)  # stale scales may be NaN
                v = v.astype(q.dtype)
            s = attention_logits(q, k_buf[slot], scale, soft_cap, k_scale)
            s = jnp.where(seen, s, -jnp.inf)
            key = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
            used = key < ctx
            if windowed:
                used &= key >= lo
            v = jnp.where(used, v, jnp.zeros_like(v))  # stale slots may be NaN
            return online_softmax_step(s, v, *carry, v_scale=v_scale)

        _, den, acc = tpu.paged_flash_loop(
            first_step=jax.lax.div(lo, block_k) if windowed else 0,
            num_steps=cdiv(kv_end, block_k),
            fetch=fetch,
            compute=compute,
            init=softmax_init(rows, head_dim),
        )
        out = softmax_finish(den, acc).astype(o_ref.dtype).reshape(o_ref.shape)
        mine = (token_out >= q_start) & (token_out < q_end)
        o_ref[...] = jnp.where(mine, out, o_ref[...])
        return seq + 1

    jax.lax.while_loop(more, attend, first_seq_ref[tile])


def _first_seqs(qsl, num_tiles: int, block_q: int, num_seqs: int) -> jax.Array:
    """i32[num_tiles]: the first sequence owning a row of each tile. compare_all: one
    [num_tiles, num_seqs + 1] comparison, no while loop in the step's program."""
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(qsl, tile_start, side="right", method="compare_all") - 1
    return jnp.clip(first.astype(jnp.int32), 0, num_seqs)


def tpu_prefill(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    kv: m.PagedKV,
    md: m.AttentionMetadata,
    opts: m.AttentionOptions,
    *,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]; rows owned by no sequence are zero
    interpret = tpu.interpret_params(interpret)
    g = wrapper.geometry(q, kv, md)
    num_tokens, num_kv_heads, group, head_dim = g.num_rows, g.num_kv_heads, g.group, g.head_dim
    if block_q is None:  # about 128 matmul rows (the MXU's height), whole sublane tiles
        block_q = max(16, next_pow2(cdiv(128, group)))
        block_q = min(block_q, cdiv(max(num_tokens, 1), 16) * 16)
    if block_q < 1 or block_q % 8:
        raise ValueError(f"block_q={block_q} must be a positive multiple of 8 on TPU")
    if pages_per_block is None:
        pages_per_block = max(1, 128 // g.block_size)
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")

    table = wrapper.whole_blocks_table(md, g, pages_per_block)
    lens = wrapper.clipped_lens(md, g)
    qsl = md.query_start_loc.astype(jnp.int32)
    num_tiles = cdiv(max(num_tokens, 1), block_q)
    first_seq = _first_seqs(qsl, num_tiles, block_q, g.num_seqs)
    padded = num_tiles * block_q
    qg = wrapper.grouped_queries(q, g, pad_rows=padded - num_tokens).transpose(1, 2, 0, 3)

    kernel = functools.partial(
        _ragged_kernel,
        scale=opts.scale,
        pages_per_block=pages_per_block,
        num_seqs=g.num_seqs,
        windowed=opts.sliding_window is not None,
        soft_cap=opts.soft_cap,
    )
    rows_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda h, t, *_: (h, 0, t, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    width = kv.k_scales.shape[2] if kv.quantized else g.block_size
    scale_bufs = tpu.scale_buffers(pages_per_block=pages_per_block, width=width)
    out = pl.pallas_call(
        with_scale_refs(kernel, 8, kv.quantized),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_kv_heads, num_tiles),
            in_specs=[rows_spec, any_spec, any_spec, any_spec, *[any_spec for _ in kv.scales]],
            out_specs=rows_spec,
            scratch_shapes=[
                pltpu.SMEM((table.shape[1],), jnp.int32),
                pltpu.SemaphoreType.DMA(()),
                *tpu.kv_buffers(
                    pages_per_block=pages_per_block,
                    block_size=g.block_size,
                    head_dim=head_dim,
                    dtype=kv.k_pages.dtype,
                ),
                *(scale_bufs if kv.quantized else []),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=tpu.compiler_params(2),
        interpret=interpret,
        name=f"paged_ragged_tpu_bs{g.block_size}_bq{block_q}_g{group}",
    )(
        lens,
        qsl,
        first_seq,
        window_operand(opts.sliding_window),
        qg,
        table,
        kv.k_pages,
        kv.v_pages,
        *kv.scales,
    )
    return out.transpose(2, 0, 1, 3)[:num_tokens].reshape(num_tokens, g.num_heads, head_dim)
