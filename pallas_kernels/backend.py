"""The attention backend: one object, chosen once (``selection.select_backend``), that writes a
step's K/V into the pool and attends over it.

Every backend has the same three operations over the same arguments (``metadata.py``):
``write_kv(kv, k_new, v_new, slot_mapping) -> kv``, ``decode(q, kv, md, opts)`` (one query row
per sequence) and ``ragged(q, kv, md, opts)`` (packed rows of many sequences, causal). A backend
is a frozen dataclass whose fields are its tuning knobs: hashable, so a jitted step takes it as
a static argument.

Contract of ``decode`` and ``ragged`` (``reference/`` is the oracle): GQA when num_heads is a
multiple of num_kv_heads; slots at or past a context length, or before a query's window, are
ignored whatever they hold (NaN included); a sequence of length 0 and rows of no sequence (or past
``max_query_len`` in theirs) give zeros.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .kv_cache import write_kv
from .metadata import AttentionMetadata, AttentionOptions, PagedKV


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: ClassVar[str] = ""
    # A ragged step's work follows its real query rows (not num_seqs x max_query_len), so the
    # runner need not bucket query lengths.
    follows_rows: ClassVar[bool] = False
    # Its work follows each sequence's context length, not the block table's width (pages past
    # a length are never read), so the runner buckets table widths coarsely.
    follows_context: ClassVar[bool] = False

    @property
    def reads_rows_only(self) -> bool:
        """Whether attention reads each query row's own keys only (the step profile's count)."""
        return False

    def write_kv(
        self,
        kv: PagedKV,
        k_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
        v_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: jax.Array,  # i32[num_tokens], negative = drop
    ) -> PagedKV:
        """Scatter the new rows into the pool in place (XLA's scatter serves every platform); an
        8-bit pool's rows are quantized and their scales written at the same slots."""
        pool = write_kv(kv.k_pages, kv.v_pages, k_new, v_new, slot_mapping, *kv.scales)
        return PagedKV(*pool)

    def decode(
        self, q: jax.Array, kv: PagedKV, md: AttentionMetadata, opts: AttentionOptions
    ) -> jax.Array:  # q, out: [num_seqs, num_heads, head_dim]
        raise NotImplementedError

    def ragged(
        self, q: jax.Array, kv: PagedKV, md: AttentionMetadata, opts: AttentionOptions
    ) -> jax.Array:  # q, out: [num_tokens, num_heads, head_dim]
        """Packed rows; a batch of single rows goes to this backend's decode kernel (which may
        split long contexts), the rest to ``prefill``."""
        if q.shape[0] == 0 or md.num_seqs == 0:
            return jnp.zeros_like(q)
        if md.max_q(q.shape[0]) == 1:
            return decode_rows(self.decode, q, kv, md, opts)
        return self.prefill(q, kv, md, opts)

    def prefill(
        self, q: jax.Array, kv: PagedKV, md: AttentionMetadata, opts: AttentionOptions
    ) -> jax.Array:  # [num_tokens, num_heads, head_dim]
        """``ragged`` for batches with rows longer than one token."""
        raise NotImplementedError

    def attend(
        self, q: jax.Array, kv: PagedKV, md: AttentionMetadata, opts: AttentionOptions
    ) -> jax.Array:
        """``decode`` for the decode layout (``md.query_start_loc`` None), else ``ragged``. A
        pool stored with a larger head_dim than q's (a TPU's rows padded to 128 lanes,
        pool_layout.py: its padding columns are zeros) is read with q padded with zeros, which
        leaves the logits as they are, and the output cut back to q's head_dim."""
        head_dim, pool_dim = q.shape[2], kv.k_pages.shape[3]
        if pool_dim > head_dim:
            q = jnp.pad(q, ((0, 0), (0, 0), (0, pool_dim - head_dim)))
        if md.query_start_loc is None:
            out = self.decode(q, kv, md, opts)
        else:
            out = self.ragged(q, kv, md, opts)
        return out[..., :head_dim] if pool_dim > head_dim else out


def zero_unowned_rows(out: jax.Array, md: AttentionMetadata) -> jax.Array:
    """Rows of no sequence, or past ``max_query_len`` in theirs, set to zero (the contract), for
    kernels that leave them unspecified."""
    keep = owned_rows(md.query_start_loc.astype(jnp.int32), out.shape[0], md.max_q(out.shape[0]))
    return jnp.where(keep[:, None, None], out, jnp.zeros_like(out))


def decode_rows(decode, q, kv: PagedKV, md: AttentionMetadata, opts: AttentionOptions):
    """A ragged batch whose sequences have at most one query row each, through ``decode`` (a
    backend's decode kernel): each sequence's row at its start; rows of no sequence are zero."""
    num_tokens = q.shape[0]
    qsl = md.query_start_loc
    starts = jnp.clip(qsl[:-1], 0, num_tokens - 1)
    out = decode(q[starts], kv, md.replace(query_start_loc=None, max_query_len=None), opts)
    has_q = qsl[1:] > qsl[:-1]
    out = jnp.where(has_q[:, None, None], out, 0)
    rows = jnp.where(has_q, starts, num_tokens)  # out of range: dropped
    return jnp.zeros_like(q).at[rows].set(out, mode="drop")


def owned_rows(
    query_start_loc: jax.Array, num_tokens: int, max_query_len: int
) -> jax.Array:  # bool[num_tokens]
    """Rows owned by a sequence within its first ``max_query_len`` queries (as the reference)."""
    num_seqs = query_start_loc.shape[0] - 1
    n = jnp.arange(num_tokens)
    # compare_all: a [num_tokens, num_seqs + 1] comparison (a few MiB at most), no while loop
    seq = jnp.searchsorted(query_start_loc, n, side="right", method="compare_all") - 1
    seq = jnp.clip(seq, 0, num_seqs - 1)
    return (n < query_start_loc[-1]) & (n - query_start_loc[seq] < max_query_len)
