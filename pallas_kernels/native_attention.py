"""Paged attention on a CPU: a native kernel (``native/paged_attention_cpu.cc``) through XLA's FFI.

XLA's own CPU code for ``paged_attention_reference`` / ``paged_attention_chunked`` gathers a
copy of every sequence's K/V and runs small batched dots over it. The native kernel reads each
live page row of the pool once, straight through the block table, and folds it into the GQA
group's queries with an online softmax; tasks (sequence x KV head x run of query rows) are shared
out over XLA's intra-op thread pool. Same contracts as the references (``paged_attention.py``,
``ragged_reference.py``): slots past a length or before a window are skipped whatever they hold,
length 0 gives zeros, rows of no sequence (or past ``max_query_len`` in theirs) are zero.

``available()`` is False where ``native.load`` declines (PAGEDJAX_NATIVE=0, not a CPU backend, no
compiler or a failed build); the dispatchers then keep XLA's path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import native
from ._common import check_kv_scales, check_window_and_cap, window_operand
from .paged_attention import check_paged_inputs

SOURCE = "paged_attention_cpu"
DECODE, RAGGED = "PagedAttentionDecode", "PagedAttentionRagged"
Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
PAGE_DTYPES = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn),
)
TILE_ROWS = 16  # query rows per ragged task: a prefill's K/V pages are re-read once per tile


def _library() -> native.Library | None:
    return native.load(SOURCE, (DECODE, RAGGED))


def available() -> bool:
    """Whether the kernel is built and may be called (a CPU backend, not switched off)."""
    return _library() is not None


def supports(q_dtype, page_dtype) -> bool:
    """Dtypes the kernel takes: f32/bf16 queries; f32, bf16, int8 or float8_e4m3fn pages."""
    return jnp.dtype(q_dtype) in Q_DTYPES and jnp.dtype(page_dtype) in PAGE_DTYPES


def _check_dtypes(q, k_pages) -> None:
    if not supports(q.dtype, k_pages.dtype):
        raise ValueError(
            f"native paged attention takes q in {[str(d) for d in Q_DTYPES]} and pages in "
            f"{[str(d) for d in PAGE_DTYPES]}, got q {q.dtype} and pages {k_pages.dtype}"
        )


def _scales(k_pages, v_pages, k_scales, v_scales):
    """The scale operands: an 8-bit pool's own, else an unread f32[1] placeholder each."""
    if check_kv_scales(k_pages, v_pages, k_scales, v_scales):
        return k_scales, v_scales
    none = jnp.zeros((1,), jnp.float32)
    return none, none


def _attrs(scale, soft_cap, num_threads) -> dict:
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be None or >= 1, got {num_threads}")
    return dict(
        scale=np.float32(scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
        max_threads=np.int64(num_threads or 0),  # 0: all of XLA's intra-op threads
    )


def _target(symbol: str) -> str:
    lib = _library()
    if lib is None:
        raise RuntimeError(
            "the native paged-attention kernel is unavailable (see the warning from "
            "pallas_kernels.native, or PAGEDJAX_NATIVE); check available() first"
        )
    return lib.target(symbol)


def paged_attention_native(
    q: jax.Array,  # [num_seqs, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[num_seqs, max_blocks]
    context_lens: jax.Array,  # i32[num_seqs]
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size] (8-bit pool)
    v_scales: jax.Array | None = None,
    num_threads: int | None = None,  # at most this many threads; None: XLA's intra-op pool
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    """Decode attention, the contract of ``paged_attention_reference``, as one native call."""
    check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, q_rows_name="num_seqs")
    check_window_and_cap(sliding_window, soft_cap)
    _check_dtypes(q, k_pages)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"q has {q.shape[0]} sequences but block_tables has {block_tables.shape[0]}"
        )
    ks, vs = _scales(k_pages, v_pages, k_scales, v_scales)
    call = jax.ffi.ffi_call(
        _target(DECODE), jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
    )
    return call(
        q,
        k_pages,
        v_pages,
        ks,
        vs,
        block_tables.astype(jnp.int32),
        context_lens.astype(jnp.int32),
        window_operand(sliding_window),
        **_attrs(scale, soft_cap, num_threads),
    )


def ragged_paged_attention_native(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[num_seqs, max_blocks]
    context_lens: jax.Array,  # i32[num_seqs]
    query_start_loc: jax.Array,  # i32[num_seqs + 1]
    *,
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size] (8-bit pool)
    v_scales: jax.Array | None = None,
    tile_rows: int = TILE_ROWS,
    num_threads: int | None = None,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]; rows of no sequence are zero
    """Packed prefill / chunked prefill / decode rows, the contract of
    ``ragged_paged_attention_reference``, as one native call."""
    check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, q_rows_name="num_tokens")
    check_window_and_cap(sliding_window, soft_cap)
    _check_dtypes(q, k_pages)
    num_tokens, num_seqs = q.shape[0], block_tables.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc shape {query_start_loc.shape} must be ({num_seqs + 1},), num_seqs + 1"
        )
    if max_query_len is not None and not 1 <= max_query_len <= max(num_tokens, 1):
        raise ValueError(f"max_query_len={max_query_len} must be in [1, num_tokens={num_tokens}]")
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
    ks, vs = _scales(k_pages, v_pages, k_scales, v_scales)
    if num_tokens == 0 or num_seqs == 0:
        return jnp.zeros_like(q)
    max_q = num_tokens if max_query_len is None else max_query_len
    qsl = query_start_loc.astype(jnp.int32)
    attn = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if max_q == 1:  # each sequence's row at its start, as the reference's decode branch
        starts = jnp.clip(qsl[:-1], 0, num_tokens - 1)
        kv8 = dict(k_scales=k_scales, v_scales=v_scales)
        out = paged_attention_native(
            q[starts], k_pages, v_pages, block_tables, context_lens, **attn, **kv8,
            num_threads=num_threads,
        )  # fmt: skip
        has_q = qsl[1:] > qsl[:-1]
        out = jnp.where(has_q[:, None, None], out, 0)
        rows = jnp.where(has_q, starts, num_tokens)  # out of range: dropped
        return jnp.zeros_like(q).at[rows].set(out, mode="drop")
    call = jax.ffi.ffi_call(
        _target(RAGGED), jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
    )
    return call(
        q,
        k_pages,
        v_pages,
        ks,
        vs,
        block_tables.astype(jnp.int32),
        context_lens.astype(jnp.int32),
        qsl,
        window_operand(sliding_window),
        **_attrs(scale, soft_cap, num_threads),
        max_query_len=np.int64(max_q),
        tile_rows=np.int64(tile_rows),
    )
