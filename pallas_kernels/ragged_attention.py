"""Attention for packed (ragged) batches over a paged KV pool: prefill, chunked prefill, decode.

Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they are its LAST
tokens, so query ``j`` of a sequence with ``q_len`` queries and ``context_len`` tokens sits at
position ``context_len - q_len + j`` and sees keys ``0 ..= that position`` (causal with offset),
or, under a sliding window of w tokens, the last w of them. The new tokens' K/V must already be
written into the pool.

Kernels: on GPU (``_gpu_ragged``) one program per (sequence, KV head, tile of its query rows); on
TPU (``_tpu_ragged``) one per (KV head, tile of packed rows), looping over the sequences owning
the tile's rows. A call whose ``max_query_len`` is 1 (pure decode) goes to the decode kernels,
which split long contexts into partitions. Elsewhere (the CPU) the native kernel of
``native_attention`` runs where it is built, else ``ragged_paged_attention_reference``
(``ragged_reference``), its work following the real query rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import native, native_attention
from ._common import check_kv_scales, check_window_and_cap
from ._gpu_ragged import ragged_paged_attention_gpu
from ._tpu_ragged import ragged_paged_attention_tpu
from .paged_attention import (
    check_paged_inputs,
    paged_attention,
    pick_backend,
    tpu_interpret_params,
)
from .ragged_reference import ragged_paged_attention_reference


def packed_row_mask(
    query_start_loc: jax.Array, num_tokens: int, max_query_len: int
) -> jax.Array:  # bool[num_tokens]
    """Rows owned by a sequence within its first ``max_query_len`` queries (as the reference)."""
    num_seqs = query_start_loc.shape[0] - 1
    n = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, n, side="right") - 1, 0, num_seqs - 1)
    return (n < query_start_loc[-1]) & (n - query_start_loc[seq] < max_query_len)


def _decode_rows(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, **kwargs):
    """max_query_len == 1: each sequence's (at most one) row through the decode kernel."""
    num_tokens = q.shape[0]
    starts = jnp.clip(query_start_loc[:-1], 0, num_tokens - 1)
    out = paged_attention(q[starts], k_pages, v_pages, block_tables, context_lens, **kwargs)
    has_q = query_start_loc[1:] > query_start_loc[:-1]
    out = jnp.where(has_q[:, None, None], out, 0)
    rows = jnp.where(has_q, starts, num_tokens)  # out of range: dropped
    return jnp.zeros_like(q).at[rows].set(out, mode="drop")


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "max_query_len",
        "backend",
        "interpret",
        "block_q",
        "pages_per_block",
        "num_warps",
        "num_stages",
        "soft_cap",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[num_seqs, max_blocks]
    context_lens: jax.Array,  # i32[num_seqs]
    query_start_loc: jax.Array,  # i32[num_seqs + 1]
    *,
    scale: float,
    max_query_len: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size] (8-bit pool)
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    """Causal attention of packed query rows of many sequences over their paged contexts.

    ``max_query_len`` (static) bounds every sequence's query count; ``None`` means num_tokens.
    Rows past ``query_start_loc[-1]`` (padding) come back as zeros. Each sequence needs
    ``query_len <= context_len``.

    ``soft_cap`` (static) caps the logits ``s = scale * q.k`` to ``soft_cap * tanh(s / soft_cap)``
    before the softmax (Gemma 2). ``sliding_window`` (None, an int, or an int32 scalar that may be
    traced, e.g. per layer inside a scan): a query at position p sees keys ``p - sliding_window <
    k <= p`` only; a value <= 0 means no window. Slots outside a query's window are ignored
    whatever they hold, and the kernels skip key blocks before every query's window.

    An 8-bit pool (int8 or float8_e4m3fn pages, as ``write_kv`` fills it) needs ``k_scales`` and
    ``v_scales``; every path reads the pages dequantized, ``pages * scales[..., None]``.

    Tuning knobs (kernels only): ``block_q`` query rows per tile (GPU: a power of two, times the
    GQA group padded to a power of two at least 16; TPU: a multiple of 8), ``pages_per_block``
    pages per key step, ``num_warps``/``num_stages`` for the GPU lowering. ``interpret=True`` runs
    the chosen kernel in interpret mode (tests on CPU).
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, q_rows_name="num_tokens")
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    check_window_and_cap(sliding_window, soft_cap)
    if query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(
            f"query_start_loc shape {query_start_loc.shape} must be "
            f"({block_tables.shape[0] + 1},), num_seqs + 1"
        )
    if max_query_len is not None and not 1 <= max_query_len <= max(q.shape[0], 1):
        raise ValueError(f"max_query_len={max_query_len} must be in [1, num_tokens={q.shape[0]}]")
    backend = pick_backend(backend, block_size=k_pages.shape[2], head_dim=q.shape[2])
    args = (q, k_pages, v_pages, block_tables, context_lens, query_start_loc)
    max_q = q.shape[0] if max_query_len is None else max_query_len
    attn = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "reference" or q.shape[0] == 0:
        kv8 = dict(k_scales=k_scales, v_scales=v_scales)
        if native_attention.available() and native_attention.supports(q.dtype, k_pages.dtype):
            return native.on_cpu(
                native_attention.ragged_paged_attention_native,
                ragged_paged_attention_reference,
                *args,
                max_query_len=max_query_len,
                **kv8,
                **attn,
            )
        return ragged_paged_attention_reference(*args, max_query_len=max_query_len, **kv8, **attn)
    attn.update(k_scales=k_scales, v_scales=v_scales)
    if max_q == 1:
        return _decode_rows(
            *args,
            **attn,
            backend=backend,
            interpret=interpret,
            pages_per_block=pages_per_block,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    if backend == "gpu":
        out = ragged_paged_attention_gpu(
            *args,
            **attn,
            max_query_len=max_q,
            block_q=block_q,
            pages_per_block=pages_per_block,
            num_warps=num_warps,
            num_stages=num_stages,
            interpret=interpret,
        )
    else:
        out = ragged_paged_attention_tpu(
            *args,
            **attn,
            block_q=block_q,
            pages_per_block=pages_per_block,
            interpret=tpu_interpret_params(interpret),
        )
    keep = packed_row_mask(query_start_loc.astype(jnp.int32), q.shape[0], max_q)
    return jnp.where(keep[:, None, None], out, jnp.zeros_like(out))
