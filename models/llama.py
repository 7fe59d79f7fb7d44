"""The Llama family (Llama 2/3, Mistral, Qwen2) over a paged KV pool.

Flax holds the parameters; ``forward(params, kv_pool, step_input, config)`` is a pure function
returning ``(logits, kv_pool)``. Each layer writes its new K/V into the pool by slot mapping, then
attends through the block tables. One code path serves prefill (packed, ragged) and decode.

The layers run under ``nn.scan`` over stacked parameters (``params["layers"]``, leading axis
``num_layers``), so a compiled step holds one copy of the layer whatever the model's depth.
The pool is one K and one V array for all layers, ``[num_kv_heads, num_layers * num_blocks,
block_size, head_dim]``: layer ``l``'s block ``b`` is pool block ``l * num_blocks + b``
(``layer_block``). Each layer offsets its slot mapping and block tables by its first block, so
the kernels read and write the layer's pages in place, with no slice of the pool ever copied.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import pallas_kernels
from .config import ModelConfig
from .sharding import AXIS, POOL_SPEC
from .step_input import StepInput

# (k_pages, v_pages), each [num_kv_heads, num_layers * num_blocks, block_size, head_dim].
KVPool = tuple[jax.Array, jax.Array]


def init_kv_pool(
    config: ModelConfig, num_blocks: int, block_size: int, dtype, sharding=None
) -> KVPool:
    """Zeroed pool of ``num_blocks`` blocks per layer; with a sharding, each device allocates
    only its slice."""
    if config.num_layers * num_blocks * block_size >= 2**31:
        raise ValueError(
            f"num_blocks={num_blocks} x block_size={block_size} x {config.num_layers} layers "
            "exceeds the int32 slot range of the pool"
        )
    shape = (config.num_kv_heads, config.num_layers * num_blocks, block_size, config.head_dim)
    return (
        jnp.zeros(shape, dtype, device=sharding),
        jnp.zeros(shape, dtype, device=sharding),
    )


def layer_block(pool: jax.Array, config: ModelConfig, layer: int, block):
    """The pool index of ``layer``'s block ``block`` (an int or an array of them)."""
    return layer * (pool.shape[1] // config.num_layers) + block


def layer_pages(pool: jax.Array, config: ModelConfig, layer: int) -> jax.Array:
    """``layer``'s pages, [num_kv_heads, num_blocks, block_size, head_dim] (a copy: for tests and
    inspection, never inside a step)."""
    num_blocks = pool.shape[1] // config.num_layers
    return pool[:, layer * num_blocks : (layer + 1) * num_blocks]


def kv_pool_bytes_per_block(config: ModelConfig, block_size: int, dtype) -> int:
    per_layer = 2 * config.num_kv_heads * block_size * config.head_dim
    return per_layer * config.num_layers * jnp.dtype(dtype).itemsize


def rope_inv_freq(config: ModelConfig) -> np.ndarray:  # f32[head_dim // 2]
    dim = config.head_dim
    inv_freq = 1.0 / (
        np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    )
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
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim] (halves repeated)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return weight * xf.astype(self.dtype)


def _dense(features: int, bias: bool, dtype, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name)


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    backend: str
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x, cos, sin, kv: KVPool, layer, step: StepInput):
        c = self.config
        tokens = x.shape[0]
        q = _dense(c.num_heads * c.head_dim, c.qkv_bias, self.dtype, "q_proj")(x)
        k = _dense(c.num_kv_heads * c.head_dim, c.qkv_bias, self.dtype, "k_proj")(x)
        v = _dense(c.num_kv_heads * c.head_dim, c.qkv_bias, self.dtype, "v_proj")(x)
        q = apply_rope(q.reshape(tokens, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(tokens, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(tokens, c.num_kv_heads, c.head_dim)
        scale = c.head_dim**-0.5
        backend, max_q = self.backend, step.max_query_len
        # This layer's blocks start at block `first` of the pool; padding slots stay negative.
        first = layer * (kv[0].shape[1] // c.num_layers)  # i32[]
        block_size = kv[0].shape[2]
        slots = jnp.where(step.slot_mapping < 0, -1, step.slot_mapping + first * block_size)
        tables = step.block_tables + first

        def attend(q, k, v, k_pages, v_pages, slots, tables, lens, qsl):
            k_pages, v_pages = pallas_kernels.write_kv(k_pages, v_pages, k, v, slots)
            if max_q == 1 and q.shape[0] == tables.shape[0]:
                # Decode layout: row i is sequence i's only query.
                out = pallas_kernels.paged_attention(
                    q, k_pages, v_pages, tables, lens, scale=scale, backend=backend
                )
            else:
                out = pallas_kernels.ragged_paged_attention(
                    q,
                    k_pages,
                    v_pages,
                    tables,
                    lens,
                    qsl,
                    scale=scale,
                    max_query_len=max_q,
                    backend=backend,
                )
            return out, k_pages, v_pages

        if self.mesh is not None:  # each device attends with its heads over its pool slice
            heads, pool, rep = P(None, AXIS, None), POOL_SPEC, P()
            attend = jax.shard_map(
                attend,
                mesh=self.mesh,
                in_specs=(heads, heads, heads, pool, pool) + (rep,) * 4,
                out_specs=(heads, pool, pool),
                check_vma=False,
            )
        out, k_pages, v_pages = attend(
            q,
            k,
            v,
            *kv,
            slots,
            tables,
            step.context_lens,
            step.query_start_loc,
        )
        out = out.reshape(tokens, c.num_heads * c.head_dim)
        return _dense(c.hidden_size, c.o_bias, self.dtype, "o_proj")(out), (k_pages, v_pages)


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        c = self.config
        gate = _dense(c.intermediate_size, c.mlp_bias, self.dtype, "gate_proj")(x)
        up = _dense(c.intermediate_size, c.mlp_bias, self.dtype, "up_proj")(x)
        return _dense(c.hidden_size, c.mlp_bias, self.dtype, "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One layer as a scan body: carry ``(x, kv_pool)``, scanned over the layer index."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: str
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, carry, layer, cos, sin, step: StepInput):
        x, kv = carry  # x: [num_tokens, hidden]; layer: i32[]
        eps = self.config.rms_norm_eps
        h = RMSNorm(eps, self.dtype, name="input_layernorm")(x)
        h, kv = Attention(self.config, self.dtype, self.backend, self.mesh, name="self_attn")(
            h, cos, sin, kv, layer, step
        )
        x = x + h
        h = RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x)
        return (x + MLP(self.config, self.dtype, name="mlp")(h), kv), None


class LlamaModel(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    backend: str = "auto"
    mesh: Mesh | None = None  # tensor parallelism by heads (models/sharding.py)
    unroll_layers: bool = False  # unroll the layer scan (one copy of the layer per layer)

    @nn.compact
    def __call__(self, kv_pool: KVPool, step: StepInput):
        c = self.config
        embed = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=self.dtype,
            param_dtype=self.dtype,
            name="embed_tokens",
        )
        x = embed(step.token_ids)  # [num_tokens, hidden]
        freqs = step.positions.astype(jnp.float32)[:, None] * rope_inv_freq(c)[None, :]
        freqs = jnp.concatenate([freqs, freqs], axis=-1)  # [num_tokens, head_dim]
        cos, sin = jnp.cos(freqs).astype(self.dtype), jnp.sin(freqs).astype(self.dtype)
        layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.num_layers,
            unroll=c.num_layers if self.unroll_layers else 1,
        )(c, self.dtype, self.backend, self.mesh, name="layers")
        layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
        (x, kv_pool), _ = layers((x, tuple(kv_pool)), layer_ids, cos, sin, step)
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x[step.logits_indices])
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = _dense(c.vocab_size, False, self.dtype, "lm_head")(x)
        if self.mesh is not None:
            # The head is split by vocabulary: each device computes its columns of the logits,
            # then the rows are gathered (not the head's weights) so every device has them whole.
            if c.vocab_size % self.mesh.shape[AXIS] == 0:
                logits = _constrain(logits, self.mesh, P(None, AXIS))
            logits = _constrain(logits, self.mesh, P())
        return logits.astype(jnp.float32), kv_pool  # [num_logits, vocab]


def _constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def forward(
    params,
    kv_pool: KVPool,
    step_input: StepInput,
    config: ModelConfig,
    backend: str = "auto",
    mesh: Mesh | None = None,
    unroll_layers: bool = False,
):
    """Pure forward: ``(params, kv_pool, step_input) -> (logits f32[num_logits, vocab], kv_pool)``.

    The compute dtype is the parameters' dtype. With a ``mesh``, parameters and pool are sharded
    by heads (models/sharding.py) and attention runs per device under shard_map.
    ``unroll_layers`` compiles one copy of the layer per layer (as a model without the scan
    would; for comparing compile times).
    """
    dtype = jax.tree.leaves(params)[0].dtype
    model = LlamaModel(config, dtype, backend, mesh, unroll_layers)
    return model.apply({"params": params}, kv_pool, step_input)


@functools.lru_cache(maxsize=16)
def param_shapes(config: ModelConfig, dtype_name: str = "float32"):
    """The parameter tree as ShapeDtypeStructs (no memory allocated). Per-layer parameters sit
    under ``"layers"`` with a leading ``num_layers`` axis."""
    dtype = jnp.dtype(dtype_name)
    pool_shape = (config.num_kv_heads, 2 * config.num_layers, 4, config.head_dim)
    pool = (jax.ShapeDtypeStruct(pool_shape, dtype),) * 2
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    step = StepInput(
        i32((1,)),
        i32((1,)),
        i32((1,)),
        i32((1, 1)),
        i32((1,)),
        i32((2,)),
        i32((1,)),
        max_query_len=1,
    )
    model = LlamaModel(config, dtype, "reference")
    shapes = jax.eval_shape(lambda p, s: model.init(jax.random.key(0), p, s), pool, step)
    return shapes["params"]
