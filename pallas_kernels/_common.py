"""Pieces shared by the GPU and TPU kernels: the online-softmax step, partition merging, tiling.

The softmax helpers operate on values (not refs) and use only ops that lower on Triton, Mosaic TPU
and Mosaic GPU, so every kernel body runs the same arithmetic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a, b):
    """Ceiling division of non-negative integers; on traced values ``lax.div`` (truncating, which
    Mosaic lowers directly, unlike ``//``'s floor semantics)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return jax.lax.div(a + b - 1, b)


def attention_logits(
    q, k, scale: float, soft_cap: float | None = None, k_scale=None, precision=None
):
    """``q @ k.T * scale`` in float32, soft-capped: q [rows, head_dim], k [block_k, head_dim].

    An 8-bit k is cast to q's dtype (exact for int8 and float8_e4m3fn in bf16/f32) and its
    per-key scales ``k_scale`` f32[1, block_k] multiply the logits' columns. ``precision``: the
    dot's (``lax.Precision``; None: the lowering's default)."""
    if k.dtype != q.dtype:
        k = k.astype(q.dtype)
    s = jax.lax.dot_general(
        q,
        k,
        (((1,), (1,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )  # [rows, block_k]
    s = s * scale
    if k_scale is not None:
        s = s * k_scale
    return cap_logits(s, soft_cap)


def cap_logits(s, soft_cap: float | None):
    """Logit soft-capping (Gemma 2): ``soft_cap * tanh(s / soft_cap)``; ``None`` leaves s as is."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def window_start(pos, window):
    """First key position a query at ``pos`` sees under a sliding window of ``window`` tokens
    (keys ``pos - window < k <= pos``); ``window <= 0`` means no window (0). ``pos`` a scalar or
    an array, ``window`` a scalar: the select is scalar, the rest elementwise (Mosaic-friendly)."""
    span = jnp.where(window > 0, window, jnp.iinfo(jnp.int32).max)
    return jnp.maximum(pos - span + 1, 0)


def online_softmax_step(s, v, m_prev, l_prev, acc_prev, v_scale=None, precision=None):
    """One flash-attention step over a block of keys.

    s: f32[rows, block_k], masked entries already -inf; v: [block_k, head_dim], rows past the
    sequence already zeroed; m_prev, l_prev: f32[rows, 1]; acc_prev: f32[rows, head_dim].
    A row whose logits so far are all -inf keeps m = -inf, den = 0, acc = 0 (no NaN from inf - inf).
    An 8-bit v comes with ``v_scale`` f32[1, block_k] (zero past the sequence): the probabilities
    are multiplied by it (v itself cast by the caller to the query's dtype, exactly).
    ``precision``: the p @ v dot's (as ``attention_logits``).
    """
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [rows, 1]
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)  # [rows, 1]; 0 where m_prev = -inf
    p = jnp.exp(s - m_safe)  # [rows, block_k]; 0 where masked
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(
        (p if v_scale is None else p * v_scale).astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )  # [rows, head_dim]
    return m_next, l_next, alpha * acc_prev + pv


def softmax_init(rows: int, head_dim: int):
    m = jnp.full((rows, 1), -jnp.inf, jnp.float32)
    den = jnp.zeros((rows, 1), jnp.float32)
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    return m, den, acc


def softmax_finish(den, acc):
    """Normalised output; a row that saw no key (l = 0) gives zeros."""
    return acc / jnp.where(den == 0.0, 1.0, den)


def merge_partitions(
    o: jax.Array,  # f32[num_splits, ..., head_dim], each partition's normalised output
    m: jax.Array,  # f32[num_splits, ...], its running max (-inf when it saw no key)
    den: jax.Array,  # f32[num_splits, ...], its softmax denominator relative to m
) -> jax.Array:  # f32[..., head_dim]
    """Combine per-partition softmax results (vLLM's paged-attention v2 reduce step)."""
    if o.shape[0] == 1:
        return o[0]
    m_max = jnp.max(m, axis=0)
    m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = den * jnp.exp(m - m_safe)  # [num_splits, ...]; 0 for empty partitions
    denom = jnp.sum(w, axis=0)
    out = jnp.sum(o * w[..., None], axis=0)
    return out / jnp.where(denom == 0.0, 1.0, denom)[..., None]


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """How a decode call is cut: keys in blocks of whole pages, contexts into partitions."""

    pages_per_block: int  # pages per inner-loop step (block_k = pages_per_block * block_size)
    pages_per_partition: int  # multiple of pages_per_block
    num_splits: int  # partitions per sequence; the block table is padded to cover them

    @property
    def padded_max_blocks(self) -> int:
        return self.pages_per_partition * self.num_splits


def decode_tiling(
    *,
    block_size: int,
    max_blocks: int,
    pages_per_block: int,
    partition_size: int | None,
    default_splits: int,
) -> DecodeTiling:
    """Validate the knobs and choose the partitioning.

    ``partition_size`` (tokens, a multiple of ``pages_per_block * block_size``) fixes it; ``None``
    uses ``default_splits`` partitions, each rounded up to whole key blocks.
    """
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
    block_k = pages_per_block * block_size
    blocks_per_seq = cdiv(max(max_blocks, 1), pages_per_block)  # key blocks covering the table
    if partition_size is None:
        num_splits = max(1, min(default_splits, blocks_per_seq))
        blocks_per_partition = cdiv(blocks_per_seq, num_splits)
    else:
        if partition_size <= 0 or partition_size % block_k:
            raise ValueError(
                f"partition_size={partition_size} must be a positive multiple of "
                f"pages_per_block * block_size = {block_k}"
            )
        blocks_per_partition = partition_size // block_k
    num_splits = cdiv(blocks_per_seq, blocks_per_partition)
    return DecodeTiling(
        pages_per_block=pages_per_block,
        pages_per_partition=blocks_per_partition * pages_per_block,
        num_splits=num_splits,
    )


def check_window_and_cap(sliding_window, soft_cap) -> None:
    """``sliding_window``: None, or an integer scalar (traced is fine); ``soft_cap``: None or a
    positive Python number (static)."""
    if sliding_window is not None:
        shape = jnp.shape(sliding_window)
        dtype = jnp.result_type(sliding_window)
        if shape != () or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"sliding_window must be None or an integer scalar, got shape {shape} {dtype}"
            )
    if soft_cap is not None and (
        isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float)) or not soft_cap > 0
    ):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")


def window_operand(sliding_window) -> jax.Array:
    """The window as the kernels take it: i32[1], 0 for none."""
    if sliding_window is None:
        return jnp.zeros((1,), jnp.int32)
    return jnp.reshape(jnp.asarray(sliding_window, jnp.int32), (1,))


def pad_block_tables(block_tables: jax.Array, num_cols: int) -> jax.Array:
    """Pad with the null block (0) up to ``num_cols`` columns."""
    extra = num_cols - block_tables.shape[1]
    if extra < 0:
        raise AssertionError(f"cannot pad {block_tables.shape} down to {num_cols} columns")
    return jnp.pad(block_tables, ((0, 0), (0, extra))) if extra else block_tables


# 8-bit KV pools: K/V pages in one of these dtypes, plus f32 scales [num_kv_heads, num_blocks,
# scale_width] (one per token per KV head, symmetric, token t of a block in column t; the columns
# past block_size, a TPU pool's padding to whole 128-lane rows, pool_layout.py, unused):
# value = pages.astype(f32) * scales[..., :block_size, None].
KV8_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def is_kv8(dtype) -> bool:
    return jnp.dtype(dtype) in KV8_DTYPES


def check_kv_scales(k_pages, v_pages, k_scales, v_scales) -> bool:
    """Validate an 8-bit pool's scales (or their absence); returns whether the pool is 8-bit."""
    quantized = is_kv8(k_pages.dtype)
    if is_kv8(v_pages.dtype) != quantized:
        raise ValueError(
            f"k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) "
            "must both be 8-bit or both not"
        )
    given = (k_scales is not None, v_scales is not None)
    if given[0] != given[1]:
        raise ValueError("k_scales and v_scales must be given together")
    if quantized and not given[0]:
        raise ValueError(
            f"an 8-bit pool ({k_pages.dtype}) needs k_scales and v_scales, "
            f"f32{list(k_pages.shape[:3])}"
        )
    if given[0] and not quantized:
        raise ValueError(
            f"k_scales/v_scales given but the pool is {k_pages.dtype}, not int8 or float8_e4m3fn"
        )
    if quantized:
        want = tuple(k_pages.shape[:3])  # [num_kv_heads, num_blocks, block_size]
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            ok = s.ndim == 3 and s.shape[0] == want[0] and s.shape[1] >= want[1]
            ok = ok and s.shape[2] >= want[2]
            if not ok or s.dtype != jnp.float32 or s.shape != k_scales.shape:
                raise ValueError(
                    f"{name} must be float32{list(want)} (the pool's [num_kv_heads, num_blocks, "
                    f"block_size]; on a TPU padded: pool_layout.py) like the other scales, got "
                    f"{s.dtype}{list(s.shape)}"
                )
    return quantized


def require_block_scale_rows(kv) -> None:
    """For kernels that read an 8-bit pool's scales as [num_kv_heads, num_blocks, block_size]
    (the GPU and CPU layout; a TPU pool's rows are padded: pool_layout.py)."""
    if kv.quantized and kv.k_scales.shape[2] != kv.block_size:
        raise ValueError(
            f"scales of {kv.k_scales.shape[2]} columns for blocks of {kv.block_size}: this "
            "backend reads scale rows of block_size (a TPU pool's layout is the TPU backend's)"
        )


def dequantize(pages, scales):
    """8-bit pages (any leading shape) and their scales -> f32; float pages pass through."""
    if scales is None:
        return pages
    return pages.astype(jnp.float32) * scales[..., : pages.shape[-2], None]


def with_scale_refs(kernel, position: int, quantized: bool):
    """A kernel taking ``ks_ref, vs_ref`` at ``position`` among its refs; for a float pool they
    are not passed to ``pallas_call`` and the kernel sees None."""
    if quantized:
        return kernel

    def body(*refs):
        return kernel(*refs[:position], None, None, *refs[position:])

    return body
