"""Decode attention on a CPU in XLA (the native backend's path without its kernel): online
softmax over chunks.

``reference_decode`` (the oracle) gathers every sequence's whole block table at once: a
``[num_seqs, num_kv_heads, max_blocks * block_size, head_dim]`` copy of K and of V, sized by the
padded table width, not by the real contexts. On a CPU that copy falls out of the caches and the
step pays for it twice (write, then read). This path walks the tables in chunks of a few blocks,
as the GPU/TPU kernels walk their pages: each chunk's K/V is gathered (small, cache-resident),
scored and folded into a running max, denominator and output (flash attention's update), and the
loop stops at the longest real context of the batch and starts at the earliest window start.

Measured per layer on the 2-core CPU (SmolLM2's 9 query / 3 kv heads, 64 sequences, f32): a
32-block table with contexts of 256-512 tokens, 19 ms -> 9.4 ms; with contexts of 128-256, 17 ms ->
4.3 ms; a 16-block table full, about even.

An 8-bit pool (``k_scales``/``v_scales`` given) is dequantized chunk by chunk, so the loop reads
one byte per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._common import cap_logits, dequantize, window_start
from ..metadata import AttentionMetadata, AttentionOptions, PagedKV

CHUNK_TOKENS = 64  # keys per loop step (4 blocks of 16)
# Tables up to this many tokens take the one-pass reference: there its gather stays in cache and
# the loop's steps cost more than they save (measured: even at 16 blocks of 16; at 32 blocks the
# loop is 2x faster full and 4x when the contexts fill half the table).
SINGLE_PASS_TOKENS = 256


def _dequantized(pages, scales, ids):
    """Blocks ``ids`` [num_seqs, n] of a pool -> f32[num_kv_heads, num_seqs, n * bs, head_dim]."""
    x = dequantize(pages[:, ids], None if scales is None else scales[:, ids])
    kh, s, n, bs, d = x.shape  # [kv_heads, num_seqs, n, bs, head_dim]
    return x.astype(jnp.float32).reshape(kh, s, n * bs, d)


def chunked_decode(
    q: jax.Array,  # [num_seqs, num_heads, head_dim]
    kv: PagedKV,
    md: AttentionMetadata,
    opts: AttentionOptions,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    """Same contract as ``reference_decode`` (slots at or past a context, or before its window,
    are ignored whatever they hold, NaN included; length 0 gives zeros)."""
    k_pages, v_pages, k_scales, v_scales = kv.k_pages, kv.v_pages, kv.k_scales, kv.v_scales
    block_tables, context_lens = md.block_tables, md.context_lens
    scale, sliding_window, soft_cap = opts.scale, opts.sliding_window, opts.soft_cap
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    chunk = max(1, min(width, chunk_tokens // block_size))  # blocks per loop step
    num_chunks = -(-width // chunk)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * chunk - width)))
    span = chunk * block_size
    first = jnp.zeros_like(context_lens)
    if sliding_window is not None:  # the query sits at position context_len - 1
        first = window_start(context_lens - 1, sliding_window)
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
    qg = qg.swapaxes(0, 1)  # [kv_heads, num_seqs, group, head_dim]

    def step(i, carry):
        m, den, acc = carry  # [kv_heads, num_seqs, group] x2, [..., head_dim]
        ids = lax.dynamic_slice_in_dim(tables, i * chunk, chunk, axis=1)  # [num_seqs, chunk]
        k = _dequantized(k_pages, k_scales, ids)  # [kv_heads, num_seqs, span, head_dim]
        v = _dequantized(v_pages, v_scales, ids)
        pos = i * span + jnp.arange(span)
        valid = (pos[None, :] < context_lens[:, None]) & (pos[None, :] >= first[:, None])
        s = cap_logits(jnp.einsum("ksgd,kstd->ksgt", qg, k), soft_cap)
        s = jnp.where(valid[None, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0)  # all -inf so far: no inf - inf
        p = jnp.exp(s - base[..., None])
        rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - base), 0)
        v = jnp.where(valid[None, :, :, None], v, 0)  # stale slots may hold NaN (0 * NaN = NaN)
        acc = acc * rescale[..., None] + jnp.einsum("ksgt,kstd->ksgd", p, v)
        return m_new, den * rescale + p.sum(-1), acc

    rows = (num_kv_heads, num_seqs, group)
    init = (jnp.full(rows, -jnp.inf), jnp.zeros(rows), jnp.zeros((*rows, head_dim)))
    start = 0
    if sliding_window is not None:  # padding rows (length 0) do not hold the loop back
        start = jnp.min(jnp.where(context_lens > 0, first, jnp.iinfo(jnp.int32).max)) // span
    stop = (jnp.max(context_lens) + span - 1) // span
    _, den, acc = lax.fori_loop(start, stop, step, init)
    out = acc / jnp.where(den == 0, 1, den)[..., None]
    return out.swapaxes(0, 1).reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
