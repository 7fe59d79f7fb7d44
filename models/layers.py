"""Building blocks shared by every family: norms, activations, rotary embeddings, and attention
over the paged KV pool (write this step's K/V by slot mapping, attend through the block tables).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .. import pallas_kernels
from . import quant
from .config import ModelConfig, longrope_attention_factor
from .linear import XLA_LINEAR, XlaTable
from .sharding import AXIS, pool_specs
from .step_input import StepInput

# (k_pages, v_pages), each [num_kv_heads, num_layers * num_blocks, block_size, head_dim]; an
# 8-bit pool (int8 / float8_e4m3fn pages) adds (k_scales, v_scales), each
# f32[num_kv_heads, num_layers * num_blocks, block_size].
KVPool = tuple[jax.Array, ...]

ACTIVATIONS = {
    "silu": nn.silu,
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "relu": nn.relu,
}


def activation(config: ModelConfig):
    from .config import SUPPORTED_ACTIVATIONS

    return ACTIVATIONS[SUPPORTED_ACTIVATIONS[config.hidden_act]]


class Dense(nn.Module):
    """``nn.Dense``'s parameters and arithmetic, the kernel laid out and multiplied by its
    linear ``method``, chosen at load (models/linear.py: XLA's float dot, weight-only 8-bit
    kernels with their ``kernel_scale``, or a platform's own, such as the CPU's native kernels
    reading a stacked kernel in place). ``layers``: stacked over that many layers (the scan's
    parameters), the call taking the scan's ``layer``. ``live_rows``: x's rows past it are
    padding (a method may leave them zero). ``lora``: a ModuleLoRA (models/lora_slots.py),
    whose per-row adapter product is added to whatever the method computed."""

    features: int
    use_bias: bool
    dtype: jnp.dtype
    layers: int | None = None  # stacked over this many layers (the scan's parameters)
    method: Any = XLA_LINEAR

    @nn.compact
    def __call__(self, x, layer=None, live_rows=None, lora=None):
        lead = () if self.layers is None else (self.layers,)
        shape = self.method.kernel_shape(x.shape[-1], self.features, lead)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, self.dtype)
        weights = {"kernel": kernel}
        if self.has_variable("params", quant.SCALE):
            weights[quant.SCALE] = self.get_variable("params", quant.SCALE)
        x = x.astype(self.dtype)
        y = self.method.apply(x, weights, None if self.layers is None else layer, live_rows)
        if lora is not None:  # the adapters' slots are stacked over the layers, unrolled or not
            y = y + lora.delta(x, layer)
        return self._bias(y, lead, None if self.layers is None else layer)

    def _bias(self, y, lead, layer):
        if not self.use_bias:
            return y
        bias = self.param("bias", nn.initializers.zeros, (*lead, self.features), self.dtype)
        bias = bias if self.layers is None else bias[layer]
        return y + bias.astype(self.dtype)


def dense(
    features: int,
    bias: bool,
    dtype,
    name: str,
    layers: int | None = None,
    method=XLA_LINEAR,
) -> nn.Module:
    return Dense(features, bias, dtype, layers, method, name=name)


class Embed(nn.Module):
    """``nn.Embed``'s table, laid out by its table ``method`` (models/linear.py), which also
    serves the tied LM head: ``__call__`` looks tokens up, ``attend`` is ``x @ table.T``."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype
    method: Any = XlaTable()

    def setup(self):
        shape = self.method.table_shape(self.num_embeddings, self.features)
        self.embedding = self.param("embedding", nn.linear.default_embed_init, shape, self.dtype)

    def __call__(self, ids):
        return self.method.lookup(self.embedding, ids).astype(self.dtype)

    def attend(self, x):
        return self.method.attend(x.astype(self.dtype), self.embedding)


class RMSNorm(nn.Module):
    """``(offset + weight) * x / rms(x)``; offset 0 (Llama: the product in the compute dtype) or
    1 (Gemma: the product in float32, then cast). ``layers``: stacked, taken at ``layer``."""

    eps: float
    dtype: jnp.dtype
    offset: float = 0.0
    layers: int | None = None

    @nn.compact
    def __call__(self, x, layer=None):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        lead = () if self.layers is None else (self.layers,)
        weight = self.param("weight", init, (*lead, x.shape[-1]), self.dtype)
        weight = weight if self.layers is None else weight[layer]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + weight.astype(jnp.float32))).astype(self.dtype)
        return weight * xf.astype(self.dtype)


class LayerNorm(nn.Module):
    """``nn.LayerNorm``'s parameters (``scale``, ``bias``) and arithmetic (statistics in float32,
    variance as E[x^2] - E[x]^2), stacked over ``layers`` when set (taken at ``layer``)."""

    eps: float
    dtype: jnp.dtype
    layers: int | None = None

    @nn.compact
    def __call__(self, x, layer=None):
        lead = () if self.layers is None else (self.layers,)
        features = (*lead, x.shape[-1])
        scale = self.param("scale", nn.initializers.ones, features, self.dtype)
        bias = self.param("bias", nn.initializers.zeros, features, self.dtype)
        if self.layers is not None:
            scale, bias = scale[layer], bias[layer]
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.maximum(jnp.mean(xf * xf, axis=-1, keepdims=True) - mean * mean, 0.0)
        mul = jax.lax.rsqrt(var + self.eps) * scale.astype(jnp.float32)
        return ((xf - mean) * mul + bias.astype(jnp.float32)).astype(self.dtype)


def norm(config: ModelConfig, dtype, name: str, layers: int | None = None) -> nn.Module:
    """The family's norm: RMSNorm, or LayerNorm with bias (OPT); stacked over ``layers`` when
    set (called with the scan's layer index)."""
    if config.layer_norm:
        return LayerNorm(config.rms_norm_eps, dtype, layers, name=name)
    return RMSNorm(config.rms_norm_eps, dtype, config.norm_offset, layers, name=name)


# ---- rotary embeddings ------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig, theta: float | None = None) -> np.ndarray:
    """f32[rotary_dims // 2]. With ``theta`` given: plain rope of that base (Gemma 3's local
    layers); else the config's rope with its scaling (LongRoPE: the short factors)."""
    dim = config.rotary_dims
    base = np.float32(theta if theta is not None else config.rope_theta)
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if theta is not None:
        return inv_freq.astype(np.float32)
    params = config.rope_params
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(is_medium, smoothed, scaled)
    elif rope_type == "longrope":
        inv_freq = longrope_inv_freqs(config)[0]
    return inv_freq.astype(np.float32)


def longrope_inv_freqs(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """LongRoPE's (short, long) inverse frequencies, f32[rotary_dims // 2] each."""
    params = config.rope_params
    dim = config.rotary_dims
    base = np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    short = 1.0 / (np.asarray(params["short_factor"], np.float32) * base)
    long = 1.0 / (np.asarray(params["long_factor"], np.float32) * base)
    return short.astype(np.float32), long.astype(np.float32)


def live_rows(step: StepInput) -> jax.Array:  # i32[]
    """Rows of the batch that belong to a sequence with context: the rows after them are
    padding (both layouts put the real sequences, and their rows, first)."""
    ends = step.query_start_loc[1:]
    return jnp.max(jnp.where(step.context_lens > 0, ends, 0), initial=0)


def token_seq_ids(step: StepInput) -> jax.Array:  # i32[num_tokens]
    """The sequence owning each token row (padding rows: clipped to a real one)."""
    qsl = step.query_start_loc
    rows = jnp.arange(step.token_ids.shape[0])
    seq = jnp.searchsorted(qsl, rows, side="right", method="compare_all") - 1  # no while loop
    return jnp.clip(seq, 0, qsl.shape[0] - 2)


def rope_tables(config: ModelConfig, step: StepInput, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin, each [num_tables, num_tokens, rotary_dims]: table 0 is the config's rope,
    table 1 (Gemma 3) the local layers' plain rope. LongRoPE picks, per sequence, the long
    factors once the sequence is longer than the original context (as HF does for the
    sequence it is run on, with its KV cache holding keys rotated by the factors of their
    time)."""
    c = config
    pos = step.positions.astype(jnp.float32)[:, None]  # [num_tokens, 1]
    scale = 1.0
    if c.rope_params.get("rope_type") == "longrope":
        short, long = longrope_inv_freqs(c)
        original = c.rope_params["original_max_position_embeddings"]
        use_long = step.context_lens[token_seq_ids(step)] > original  # bool[num_tokens]
        inv_freqs = [jnp.where(use_long[:, None], long[None], short[None])]
        scale = longrope_attention_factor(c)
    else:
        inv_freqs = [jnp.asarray(rope_inv_freq(c))[None]]
    if c.rope_local_theta is not None:
        inv_freqs.append(jnp.asarray(rope_inv_freq(c, c.rope_local_theta))[None])
    cos, sin = [], []
    for i, inv_freq in enumerate(inv_freqs):
        freqs = pos * inv_freq  # [num_tokens, rotary_dims // 2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        factor = scale if i == 0 else 1.0
        cos.append((jnp.cos(emb) * factor).astype(dtype))
        sin.append((jnp.sin(emb) * factor).astype(dtype))
    return jnp.stack(cos), jnp.stack(sin)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, rotary_dims] (halves repeated).
    # Partial rotary: the dims past rotary_dims pass through.
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


# ---- attention over the paged pool --------------------------------------------------------------


def static_window(config: ModelConfig) -> int | None:
    """The window as a static int when every layer shares it (Mistral, Phi-3); None when some
    layers differ (then each layer passes its own, traced) or no layer slides."""
    windows = set(config.layer_windows)
    return windows.pop() if len(windows) == 1 and 0 not in windows else None


def paged_attention(
    qkv: tuple[jax.Array, jax.Array, jax.Array],  # q, k, v: the step's projected rows
    kv: KVPool,
    layer: jax.Array,  # i32[]
    window: jax.Array | int | None,  # i32[] or int: this layer's window (<= 0: global)
    step: StepInput,
    config: ModelConfig,
    backend: pallas_kernels.AttentionBackend,
    mesh: Mesh | None,
) -> tuple[jax.Array, KVPool]:  # [num_tokens, num_heads, head_dim], pool
    """Write this step's K/V into ``layer``'s pages of the stacked pool, then attend, both
    through the attention ``backend`` the runner chose. ``qkv``: q [num_tokens, num_heads,
    head_dim], k and v [num_tokens, num_kv_heads, head_dim].

    The layer's blocks start at block ``layer * num_blocks`` of the pool: its slot mapping and
    block tables are offset there, so the kernels read and write its pages in place. With a
    mesh, each device attends with its heads over its slice of the pool (shard_map).
    """
    c = config
    max_q = step.max_query_len
    first = layer * (kv[0].shape[1] // c.num_layers)  # i32[]
    block_size = kv[0].shape[2]
    slots = jnp.where(step.slot_mapping < 0, -1, step.slot_mapping + first * block_size)
    tables = step.block_tables + first
    soft_cap = float(c.attn_soft_cap) if c.attn_soft_cap else None
    static = window if isinstance(window, int) and window > 0 else None
    traced_window = window is not None and not isinstance(window, int)

    def attend(q, k, v, pool, slots, tables, lens, qsl, *window):
        # An 8-bit pool (k, v, k_scales, v_scales): write_kv quantizes the new rows and writes
        # their scales; the attention dequantizes with them.
        kv = backend.write_kv(pallas_kernels.PagedKV.of(pool), k, v, slots)
        decode = max_q == 1 and q.shape[0] == tables.shape[0]  # row i: sequence i's only query
        md = pallas_kernels.AttentionMetadata(
            tables,
            lens,
            None if decode else qsl,
            slots,
            max_query_len=None if decode else max_q,
        )
        opts = pallas_kernels.AttentionOptions(
            c.attn_scale, window[0] if window else static, soft_cap
        )
        return backend.attend(q, kv, md, opts), kv.as_tuple()

    kv = tuple(kv)
    args = (*qkv, kv, slots, tables, step.context_lens, step.query_start_loc)
    args += (window,) if traced_window else ()
    if mesh is not None:
        heads, pool, rep = P(None, AXIS, None), pool_specs(len(kv) == 4), P()
        attend = jax.shard_map(
            attend,
            mesh=mesh,
            in_specs=(heads, heads, heads, pool) + (rep,) * (len(args) - 4),
            out_specs=(heads, pool),
            check_vma=False,
        )
    return attend(*args)
