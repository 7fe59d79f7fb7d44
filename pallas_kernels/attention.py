"""The public attention functions: the flat argument list (the DESIGN contract), written once in
``flat_entry``, packed into ``(q, PagedKV, AttentionMetadata, AttentionOptions)`` for a backend.

``paged_attention`` (decode: one query row per sequence) and ``ragged_paged_attention`` (packed
rows of many sequences, causal: sequence ``i`` owns rows ``query_start_loc[i]:[i+1]``, its last
tokens) choose their backend per call by name; ``*_reference`` are the oracles
(``reference/``). The engine does not come through here: its runner chooses a backend object once
(``selection.select_backend``) and the model calls it directly.
"""

from __future__ import annotations

import jax

from .metadata import AttentionMetadata, AttentionOptions, PagedKV, validate
from .reference import ReferenceBackend
from .selection import select_backend


def flat_entry(run, *, name: str, ragged: bool, doc: str):
    """A function of the flat arguments running ``run(q, kv, md, opts, **knobs)``; ``ragged``:
    whether it takes ``query_start_loc`` (and ``max_query_len``), else the decode layout."""

    def entry(
        q: jax.Array,  # [num_seqs (decode) or num_tokens (ragged), num_heads, head_dim]
        k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
        v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
        block_tables: jax.Array,  # i32[num_seqs, max_blocks]
        context_lens: jax.Array,  # i32[num_seqs]
        query_start_loc: jax.Array | None = None,  # i32[num_seqs + 1] (ragged only)
        *,
        scale: float,
        max_query_len: int | None = None,  # (ragged only)
        sliding_window: int | jax.Array | None = None,
        soft_cap: float | None = None,
        k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size] (8-bit)
        v_scales: jax.Array | None = None,
        **knobs,
    ) -> jax.Array:  # like q
        if ragged and query_start_loc is None:
            raise TypeError(f"{name}() needs query_start_loc")
        if not ragged and (query_start_loc is not None or max_query_len is not None):
            raise TypeError(f"{name}() takes no query_start_loc or max_query_len (decode layout)")
        kv = PagedKV(k_pages, v_pages, k_scales, v_scales)
        md = AttentionMetadata(
            block_tables, context_lens, query_start_loc, max_query_len=max_query_len
        )
        opts = AttentionOptions(scale, sliding_window, soft_cap)
        validate(q, kv, md, opts)
        return run(q, kv, md, opts, **knobs)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = doc
    return entry


def _by_name(q, kv, md, opts, *, backend: str = "auto", **knobs):
    chosen = select_backend(backend, block_size=kv.block_size, head_dim=q.shape[2], **knobs)
    return chosen.attend(q, kv, md, opts)


def _reference(q, kv, md, opts, **knobs):
    return ReferenceBackend(**knobs).attend(q, kv, md, opts)


_COMMON_DOC = """
    Slots at or past a context length are ignored whatever they hold (NaN included); a sequence
    of length 0 gives zeros. ``soft_cap`` (static) caps the logits ``s = scale * q.k`` to
    ``soft_cap * tanh(s / soft_cap)`` before the softmax (Gemma 2). ``sliding_window`` (None, an
    int, or an int32 scalar that may be traced): a query at position p sees keys
    ``p - sliding_window < k <= p`` only; <= 0 means no window. An 8-bit pool (int8 or
    float8_e4m3fn pages, as ``write_kv`` fills it) needs ``k_scales`` and ``v_scales``.
"""
_KNOBS_DOC = """
    ``backend``: a name of ``selection.BACKENDS`` ("auto": the platform's). Tuning knobs, each
    taken by the backends that have it (``TritonBackend``, ``TpuBackend``, ``NativeBackend``):
    ``pages_per_block``, ``partition_size``, ``block_q``, ``num_warps``, ``num_stages``,
    ``max_table_entries``, ``num_threads``, ``tile_rows``; ``interpret=True`` runs a Pallas
    kernel in interpret mode (tests on CPU).
"""
_STATIC = (
    "scale",
    "max_query_len",
    "soft_cap",
    "backend",
    "interpret",
    "pages_per_block",
    "partition_size",
    "block_q",
    "num_warps",
    "num_stages",
    "max_table_entries",
    "num_threads",
    "tile_rows",
)

paged_attention = jax.jit(
    flat_entry(
        _by_name,
        name="paged_attention",
        ragged=False,
        doc="Attention of one query token per sequence over its paged context; q is "
        "[num_seqs, num_heads, head_dim], GQA when num_heads is a multiple of num_kv_heads."
        + _COMMON_DOC
        + _KNOBS_DOC,
    ),
    static_argnames=_STATIC,
)
ragged_paged_attention = jax.jit(
    flat_entry(
        _by_name,
        name="ragged_paged_attention",
        ragged=True,
        doc="Causal attention of packed query rows of many sequences over their paged contexts; "
        "q is [num_tokens, num_heads, head_dim]. ``max_query_len`` (static) bounds every "
        "sequence's query count (None: num_tokens); rows past ``query_start_loc[-1]`` come back "
        "as zeros; each sequence needs query_len <= context_len." + _COMMON_DOC + _KNOBS_DOC,
    ),
    static_argnames=_STATIC,
)
paged_attention_reference = flat_entry(
    _reference,
    name="paged_attention_reference",
    ragged=False,
    doc="The oracle of ``paged_attention``: pure jnp, in float32." + _COMMON_DOC,
)
ragged_paged_attention_reference = flat_entry(
    _reference,
    name="ragged_paged_attention_reference",
    ragged=True,
    doc="The oracle of ``ragged_paged_attention``: pure jnp, in float32, its work following the "
    "real query rows (``tile_rows`` packed rows per tile)." + _COMMON_DOC,
)
