"""What every attention kernel takes, besides the queries: the paged KV, the step's attention
metadata and the options. Each backend's ``decode`` and ``ragged`` are ``(q, kv, md, opts)``.

All three are pytrees (``flax.struct.dataclass``) so they pass through ``jit``, ``shard_map`` and
``on_cpu``; static fields (``max_query_len``, ``scale``, ``soft_cap``) are ``pytree_node=False``.
``validate`` is the one place their shapes are checked.
"""

from __future__ import annotations

import jax
from flax import struct

from ._common import check_kv_scales, check_window_and_cap


@struct.dataclass
class PagedKV:
    """One layer's pool (or a stack of layers' pools addressed through offset block tables)."""

    k_pages: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim]
    # An 8-bit pool's (int8 / float8_e4m3fn pages) f32[num_kv_heads, num_blocks, block_size]:
    # value = pages * scales[..., None]. None for a float pool.
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None

    @property
    def block_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def scales(self) -> tuple:
        """``(k_scales, v_scales)`` of an 8-bit pool, ``()`` for a float pool."""
        return (self.k_scales, self.v_scales) if self.quantized else ()

    @classmethod
    def of(cls, pool) -> PagedKV:
        """From the models' tuple ``(k, v)`` or ``(k, v, k_scales, v_scales)``."""
        return cls(*pool)

    def as_tuple(self) -> tuple:
        return (self.k_pages, self.v_pages, *self.scales)


@struct.dataclass
class AttentionMetadata:
    """Where each sequence's context lives and which query rows are its own."""

    block_tables: jax.Array  # i32[num_seqs, max_blocks], padded with the null block 0
    context_lens: jax.Array  # i32[num_seqs], new tokens included
    # i32[num_seqs + 1]: sequence i owns query rows query_start_loc[i]:query_start_loc[i+1], its
    # last tokens (causal). None: the decode layout, row i is sequence i's only query.
    query_start_loc: jax.Array | None = None
    slot_mapping: jax.Array | None = None  # i32[num_tokens]: where write_kv puts each new row
    # Bounds every sequence's query count (static); None: num_tokens.
    max_query_len: int | None = struct.field(pytree_node=False, default=None)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    def max_q(self, num_tokens: int) -> int:
        return num_tokens if self.max_query_len is None else self.max_query_len


@struct.dataclass
class AttentionOptions:
    """How to attend: the same for every backend."""

    scale: float = struct.field(pytree_node=False)  # multiplies q.k
    # None, or an integer scalar (may be traced, e.g. per layer in a scan): a query at position
    # p sees keys p - sliding_window < k <= p; <= 0 means no window.
    sliding_window: int | jax.Array | None = None
    # Logits capped to soft_cap * tanh(s / soft_cap) before the softmax (Gemma 2); None: not.
    soft_cap: float | None = struct.field(pytree_node=False, default=None)

    @property
    def windowed(self) -> bool:
        return self.sliding_window is not None


def validate(q: jax.Array, kv: PagedKV, md: AttentionMetadata, opts: AttentionOptions) -> None:
    """Raise ValueError naming the bad input. Decode layout (``md.query_start_loc`` None): q is
    [num_seqs, num_heads, head_dim]; ragged: [num_tokens, num_heads, head_dim]."""
    decode = md.query_start_loc is None
    rows = "num_seqs" if decode else "num_tokens"
    if q.ndim != 3:
        raise ValueError(f"q must be [{rows}, num_heads, head_dim], got shape {q.shape}")
    k_pages, v_pages = kv.k_pages, kv.v_pages
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_kv_heads, num_blocks, block_size, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != pool head_dim {k_pages.shape[3]}")
    tables, lens = md.block_tables, md.context_lens
    if tables.ndim != 2 or lens.shape != (tables.shape[0],):
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks] and context_lens [num_seqs], got "
            f"{tables.shape} and {lens.shape}"
        )
    check_kv_scales(k_pages, v_pages, kv.k_scales, kv.v_scales)
    check_window_and_cap(opts.sliding_window, opts.soft_cap)
    if decode:
        if q.shape[0] != tables.shape[0]:
            raise ValueError(f"q has {q.shape[0]} sequences but block_tables has {tables.shape[0]}")
        return
    if md.query_start_loc.shape != (tables.shape[0] + 1,):
        raise ValueError(
            f"query_start_loc shape {md.query_start_loc.shape} must be "
            f"({tables.shape[0] + 1},), num_seqs + 1"
        )
    max_q = md.max_query_len
    if max_q is not None and not 1 <= max_q <= max(q.shape[0], 1):
        raise ValueError(f"max_query_len={max_q} must be in [1, num_tokens={q.shape[0]}]")
