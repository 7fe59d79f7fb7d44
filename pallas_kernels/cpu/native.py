"""Paged attention on a CPU: a native kernel (``../native/paged_attention_cpu.cc``) through XLA's
FFI.

XLA's own CPU code for ``reference_decode`` / ``chunked_decode`` gathers a copy of every
sequence's K/V and runs small batched dots over it. The native kernel reads each live page row of
the pool once, straight through the block table, and folds it into the GQA group's queries with an
online softmax; tasks (sequence x KV head x run of query rows) are shared out over XLA's intra-op
thread pool. Same contracts as the references (``reference/``): slots past a length or before a
window are skipped whatever they hold, length 0 gives zeros, rows of no sequence (or past
``max_query_len`` in theirs) are zero.

``available()`` is False where ``native.load`` declines (PAGEDJAX_NATIVE=0, not a CPU backend, no
compiler or a failed build); the native backend then keeps XLA's path (``cpu/__init__.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import native
from .._common import require_block_scale_rows, window_operand
from ..metadata import AttentionMetadata, AttentionOptions, PagedKV

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


def _scales(kv: PagedKV):
    """The scale operands: an 8-bit pool's own, else an unread f32[1] placeholder each."""
    if kv.quantized:
        require_block_scale_rows(kv)
        return kv.scales
    none = jnp.zeros((1,), jnp.float32)
    return none, none


def _attrs(scale, soft_cap, num_threads) -> dict:
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


def _attention_call(
    target: str,
    q: jax.Array,
    kv: PagedKV,
    md: AttentionMetadata,
    opts: AttentionOptions,
    num_threads: int | None,
    row_operands: tuple = (),  # the ragged kernel's query_start_loc
    **attrs,
) -> jax.Array:
    """One native attention call: (q, K, V, [scales], tables, lens, *row_operands, window)."""
    _check_dtypes(q, kv.k_pages)
    call = jax.ffi.ffi_call(
        _target(target), jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
    )
    return call(
        q,
        kv.k_pages,
        kv.v_pages,
        *_scales(kv),
        md.block_tables.astype(jnp.int32),
        md.context_lens.astype(jnp.int32),
        *row_operands,
        window_operand(opts.sliding_window),
        **_attrs(opts.scale, opts.soft_cap, num_threads),
        **attrs,
    )


def native_decode(
    q: jax.Array,  # [num_seqs, num_heads, head_dim]
    kv: PagedKV,
    md: AttentionMetadata,
    opts: AttentionOptions,
    *,
    num_threads: int | None = None,  # at most this many threads; None: XLA's intra-op pool
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    """Decode attention, the contract of ``reference_decode``, as one native call."""
    return _attention_call(DECODE, q, kv, md, opts, num_threads)


def native_prefill(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    kv: PagedKV,
    md: AttentionMetadata,
    opts: AttentionOptions,
    *,
    tile_rows: int = TILE_ROWS,
    num_threads: int | None = None,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]; rows of no sequence are zero
    """Packed prefill / chunked prefill / decode rows, the contract of ``reference_prefill``, as
    one native call."""
    return _attention_call(
        RAGGED,
        q,
        kv,
        md,
        opts,
        num_threads,
        (md.query_start_loc.astype(jnp.int32),),
        max_query_len=np.int64(md.max_q(q.shape[0])),
        tile_rows=np.int64(tile_rows),
    )
