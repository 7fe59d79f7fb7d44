"""Decode attention over a paged KV pool: one query token per sequence.

``paged_attention`` is the public entry point. It runs a Pallas kernel on GPU (Triton lowering,
``_gpu_decode``) or TPU (Mosaic, ``_tpu_decode``); elsewhere (the engine on CPU) the native C++
kernel of ``native_attention`` where it is built, else the pure-jnp ``paged_attention_reference``
(the oracle) for tables of up to 256 tokens and the chunked loop of ``decode_cpu`` for longer
ones. Kernels: one program per (sequence, KV head, partition) with the GQA group's query heads
as matmul rows, online softmax, long contexts split into partitions merged afterwards (vLLM's
v2), logits and value rows past the length masked.
Every path takes a sliding window and logit soft-capping (Gemma 2/3, Mistral).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._common import cap_logits, check_kv_scales, check_window_and_cap, dequantize, window_start
from ._gpu_decode import paged_attention_gpu
from ._tpu_decode import paged_attention_tpu
from .decode_cpu import SINGLE_PASS_TOKENS, paged_attention_chunked

BACKENDS = ("auto", "gpu", "tpu", "reference")


def resolve_backend(backend: str) -> str:
    """Map ``"auto"`` to the backend for the default JAX platform; validate the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    return platform if platform in ("gpu", "tpu") else "reference"


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


def paged_attention_reference(
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
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    k = gather_context(k_pages, block_tables, k_scales)  # [num_seqs, num_kv_heads, ctx, head_dim]
    v = gather_context(v_pages, block_tables, v_scales)
    t = jnp.arange(k.shape[2])
    valid = t[None, :] < context_lens[:, None]  # [num_seqs, ctx]
    if sliding_window is not None:  # the query sits at position context_len - 1
        valid &= t[None, :] >= window_start(context_lens - 1, sliding_window)[:, None]
    # Stale slots may hold NaN: zero V there, not only the probabilities (exp(-inf) * NaN = NaN).
    v = jnp.where(valid[:, None, :, None], v, 0)
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum("skgd,sktd->skgt", qg, k.astype(jnp.float32)) * scale
    s = jnp.where(valid[:, None, None, :], cap_logits(s, soft_cap), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("skgt,sktd->skgd", p, v.astype(jnp.float32))
    out = out / jnp.where(denom == 0, 1, denom)  # a sequence of length 0 gives zeros
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, *, q_rows_name):
    """Shared shape validation for the decode and ragged entry points."""
    if q.ndim != 3:
        raise ValueError(f"q must be [{q_rows_name}, num_heads, head_dim], got shape {q.shape}")
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
    if block_tables.ndim != 2 or context_lens.shape != (block_tables.shape[0],):
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks] and context_lens [num_seqs], got "
            f"{block_tables.shape} and {context_lens.shape}"
        )


def gpu_kernel_supports(block_size: int, head_dim: int) -> bool:
    """Shapes the GPU kernels take (Triton tiles are powers of two); "auto" falls back otherwise."""
    pow2 = lambda n: n > 0 and not n & (n - 1)
    return pow2(block_size) and pow2(head_dim) and head_dim >= 16


def pick_backend(backend: str, *, block_size: int, head_dim: int) -> str:
    """``resolve_backend``, except that "auto" on a GPU takes the reference for shapes the GPU
    kernel cannot tile (an explicit ``backend="gpu"`` raises instead)."""
    resolved = resolve_backend(backend)
    if backend == "auto" and resolved == "gpu" and not gpu_kernel_supports(block_size, head_dim):
        return "reference"
    return resolved


def tpu_interpret_params(interpret: bool):
    """``interpret=True`` runs a TPU kernel in TPU interpret mode (also reachable, for whole
    programs, through ``pltpu.force_tpu_interpret_mode``)."""
    if not interpret:
        return False
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "backend",
        "interpret",
        "pages_per_block",
        "partition_size",
        "num_warps",
        "num_stages",
        "soft_cap",
    ),
)
def paged_attention(
    q: jax.Array,  # [num_seqs, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[num_seqs, max_blocks]
    context_lens: jax.Array,  # i32[num_seqs]
    *,
    scale: float,
    backend: str = "auto",
    interpret: bool = False,
    pages_per_block: int | None = None,
    partition_size: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size] (8-bit pool)
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [num_seqs, num_heads, head_dim]
    """Attention of one query token per sequence over its paged context.

    GQA when num_heads is a multiple of num_kv_heads. Slots at or past ``context_lens`` are ignored
    whatever they hold (NaN included); a sequence of length 0 gives zeros.

    ``soft_cap`` (static) caps the logits ``s = scale * q.k`` to ``soft_cap * tanh(s / soft_cap)``
    before the softmax (Gemma 2). ``sliding_window`` (None, an int, or an int32 scalar that may be
    traced, e.g. per layer inside a scan): the query, at position ``context_len - 1``, sees only
    the last ``sliding_window`` tokens; a value <= 0 means no window. Slots before the window are
    ignored whatever they hold, and the kernels skip pages that lie entirely before it.

    An 8-bit pool (int8 or float8_e4m3fn pages, as ``write_kv`` fills it) needs ``k_scales`` and
    ``v_scales``; every path reads the pages dequantized, ``pages * scales[..., None]``.

    Tuning knobs (kernels only): ``pages_per_block`` pages per inner step (GPU: a power of two with
    at least 16 tokens; default 128 tokens on GPU, 256 on TPU); ``partition_size`` tokens per
    context partition (a multiple of the step; default: GPU splits until there are about 512
    programs, TPU does not split); ``num_warps``/``num_stages`` for the GPU lowering.
    ``interpret=True`` runs the chosen kernel in interpret mode (tests on CPU).
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, q_rows_name="num_seqs")
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    check_window_and_cap(sliding_window, soft_cap)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"q has {q.shape[0]} sequences but block_tables has {block_tables.shape[0]}"
        )
    backend = pick_backend(backend, block_size=k_pages.shape[2], head_dim=q.shape[2])
    knobs = dict(
        scale=scale,
        pages_per_block=pages_per_block,
        partition_size=partition_size,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if backend == "gpu":
        return paged_attention_gpu(
            q,
            k_pages,
            v_pages,
            block_tables,
            context_lens,
            k_scales=k_scales,
            v_scales=v_scales,
            num_warps=num_warps,
            num_stages=num_stages,
            interpret=interpret,
            **knobs,
        )
    if backend == "tpu":
        return paged_attention_tpu(
            q,
            k_pages,
            v_pages,
            block_tables,
            context_lens,
            k_scales=k_scales,
            v_scales=v_scales,
            interpret=tpu_interpret_params(interpret),
            **knobs,
        )
    # The engine's CPU path: the native kernel (native_attention.py) where it is built; else
    # XLA's, one pass over a short table (its gather stays in cache), chunks up to the longest
    # real context over a long one (decode_cpu.py).
    single_pass = block_tables.shape[1] * k_pages.shape[2] <= SINGLE_PASS_TOKENS
    xla_path = paged_attention_reference if single_pass else paged_attention_chunked
    args = (q, k_pages, v_pages, block_tables, context_lens)
    kwargs = dict(
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    from . import native, native_attention  # native_attention imports this module

    if native_attention.available() and native_attention.supports(q.dtype, k_pages.dtype):
        return native.on_cpu(native_attention.paged_attention_native, xla_path, *args, **kwargs)
    return xla_path(*args, **kwargs)
