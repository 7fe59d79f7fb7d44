"""The oracle for decode attention: pure jnp, float32, the whole block table gathered at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._common import cap_logits, dequantize, window_start
from ..metadata import AttentionMetadata, AttentionOptions, PagedKV


def gather_context(
    pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[num_seqs, max_blocks]
    scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size] (8-bit pool)
) -> jax.Array:  # [num_seqs, num_kv_heads, max_blocks * block_size, head_dim]; f32 if dequantized
    num_kv_heads, _, block_size, head_dim = pages.shape
    num_seqs, max_blocks = block_tables.shape
    ctx = pages[:, block_tables]  # [num_kv_heads, num_seqs, max_blocks, block_size, head_dim]
    if scales is not None:
        ctx = dequantize(ctx, scales[:, block_tables])
    ctx = ctx.reshape(num_kv_heads, num_seqs, max_blocks * block_size, head_dim)
    return ctx.swapaxes(0, 1)


def reference_decode(
    q: jax.Array,  # [num_seqs, num_heads, head_dim]
    kv: PagedKV,
    md: AttentionMetadata,
    opts: AttentionOptions,
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv.k_pages.shape[0]
    group = num_heads // num_kv_heads
    context_lens = md.context_lens
    k = gather_context(kv.k_pages, md.block_tables, kv.k_scales)  # [S, Hkv, ctx, D]
    v = gather_context(kv.v_pages, md.block_tables, kv.v_scales)
    t = jnp.arange(k.shape[2])
    valid = t[None, :] < context_lens[:, None]  # [num_seqs, ctx]
    if opts.windowed:  # the query sits at position context_len - 1
        valid &= t[None, :] >= window_start(context_lens - 1, opts.sliding_window)[:, None]
    # Stale slots may hold NaN: zero V there, not only the probabilities (exp(-inf) * NaN = NaN).
    v = jnp.where(valid[:, None, :, None], v, 0)
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum("skgd,sktd->skgt", qg, k.astype(jnp.float32)) * opts.scale
    s = jnp.where(valid[:, None, None, :], cap_logits(s, opts.soft_cap), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("skgt,sktd->skgd", p, v.astype(jnp.float32))
    out = out / jnp.where(denom == 0, 1, denom)  # a sequence of length 0 gives zeros
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
