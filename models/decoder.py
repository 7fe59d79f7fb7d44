"""The shared decoder: every family is a config-driven variant of it (models/registry.py).

Flax holds the parameters; ``DecoderModel(...).apply({"params": p}, kv_pool, step)`` returns
``(logits, kv_pool)``. One code path serves prefill (ragged) and decode.

Two layer loops, chosen at load (models/layer_loop.py). Under ``nn.scan`` over stacked parameters
(``params["layers"]``, leading axis ``num_layers``; a CPU's), a compiled step holds one copy of
the layer whatever the model's depth. The stack is broadcast into the scan and each layer reads
its row where it lies (the CPU's linear methods, models/linear.py), rather than the scan
slicing it: XLA copies a slice before its dot. What differs between the layers is then scanned
data, never a Python branch per layer: the attention window (Gemma's alternating local/global
layers, Qwen's max_window_layers), the rope table (Gemma 3's local base), and for MoE families
the row of the layer's MLP stack and its kind (models/moe.py). Unrolled (``layers_{i}``, one
parameter tree per layer; every other platform's), each layer's dots read whole arrays and the
same differences are Python values (``layer_data``), but the layer's index: one traced layer
function serves every layer of a kind (``_unrolled_layers``).

Variants, by config field: q/k norms (Qwen3, Gemma 3); Gemma's (1 + weight) norms, four per layer,
embedding scale, GeGLU, query_pre_attn_scalar and soft caps; MoE MLPs; partial rotary and
LongRoPE (Phi-3, whose fused projections are split at load); OPT's learned positions, LayerNorm,
ReLU MLP with biases, post-norm layers and embedding projections.
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
from .layers import (
    Embed,
    KVPool,
    activation,
    apply_rope,
    dense,
    live_rows,
    norm,
    paged_attention,
    rope_tables,
    static_window,
)
from .linear import WeightLayout
from .lora_slots import LoRABatch
from .moe import layer_mlp, mlp_stacks, own_mlp
from .sharding import AXIS
from .step_input import StepInput


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    backend: pallas_kernels.AttentionBackend  # chosen once, by the runner
    mesh: Mesh | None = None
    layout: WeightLayout = WeightLayout()  # each projection's linear method (models/linear.py)
    stacked: bool = True  # parameters stacked over the layers (the scan), taken at ``layer``

    @nn.compact
    def __call__(self, x, rotary, kv: KVPool, layer, window, step: StepInput, live, lora=None):
        # rotary: this layer's (cos, sin) tables, None without rotary embeddings
        c = self.config
        n = c.num_layers if self.stacked else None
        tokens = x.shape[0]

        def linear(features, bias, name):
            method = self.layout.linear(f"self_attn/{name}")
            module = dense(features, bias, self.dtype, name, n, method)
            return lambda h: module(h, layer, live, _module_lora(lora, name))

        q = linear(c.num_heads * c.head_dim, c.qkv_bias, "q_proj")(x)
        k = linear(c.num_kv_heads * c.head_dim, c.qkv_bias, "k_proj")(x)
        v = linear(c.num_kv_heads * c.head_dim, c.qkv_bias, "v_proj")(x)
        q = q.reshape(tokens, c.num_heads, c.head_dim)
        k = k.reshape(tokens, c.num_kv_heads, c.head_dim)
        v = v.reshape(tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # per head, over head_dim
            q = norm(c, self.dtype, "q_norm", n)(q, layer)
            k = norm(c, self.dtype, "k_norm", n)(k, layer)
        if rotary is not None:
            q, k = apply_rope(q, *rotary), apply_rope(k, *rotary)
        out, kv = paged_attention((q, k, v), kv, layer, window, step, c, self.backend, self.mesh)
        out = out.reshape(tokens, c.num_heads * c.head_dim)
        return linear(c.hidden_size, c.o_bias, "o_proj")(out), kv


class MLP(nn.Module):
    """Gated (``down(act(gate(x)) * up(x))``) or plain (OPT: ``down(act(up(x)))``)."""

    config: ModelConfig
    dtype: jnp.dtype
    layout: WeightLayout = WeightLayout()  # each projection's linear method (models/linear.py)
    stacked: bool = True  # parameters stacked over the layers, taken at ``layer``

    @nn.compact
    def __call__(self, x, layer, live=None, lora=None):
        c = self.config
        act = activation(c)
        n = c.num_layers if self.stacked else None

        def linear(features, name):
            method = self.layout.linear(f"mlp/{name}")
            module = dense(features, c.mlp_bias, self.dtype, name, n, method)
            return lambda h: module(h, layer, live, _module_lora(lora, name))

        up = linear(c.intermediate_size, "up_proj")(x)
        if c.gated_mlp:
            gate = linear(c.intermediate_size, "gate_proj")(x)
            up = act(gate) * up
        else:
            up = act(up)
        return linear(c.hidden_size, "down_proj")(up)


def _module_lora(lora: LoRABatch | None, name: str):
    """Projection ``name``'s adapter slots and the rows' slots, or None (no LoRA op at all)."""
    return None if lora is None else lora.module(name)


class DecoderLayer(nn.Module):
    """One layer: carry ``(x, kv_pool)`` -> ``((x, kv_pool), None)``. Under the scan its
    parameters are stacked over the layers (broadcast into the scan), ``per_layer`` is the
    scanned data and ``per_layer["layer"]`` picks their row; unrolled (``stacked`` off) the
    layer holds its own parameters and ``per_layer`` is ``layer_data``'s Python values.
    ``lora``: a LoRABatch (models/lora_slots.py) whose slots, stacked over the layers, are read
    at ``layer`` too; None adds nothing to the program."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: pallas_kernels.AttentionBackend  # chosen once, by the runner
    mesh: Mesh | None = None
    layout: WeightLayout = WeightLayout()
    stacked: bool = True

    @nn.compact
    def __call__(self, carry, per_layer, cos, sin, step: StepInput, stacks, lora=None):
        x, kv = carry  # x: [num_tokens, hidden]
        c, dt = self.config, self.dtype
        rotary = None
        if cos is not None:  # [num_tables, num_tokens, rotary_dims] -> this layer's table
            table = per_layer.get("rope", 0)
            rotary = (cos[table], sin[table])
        window = static_window(c)
        window = per_layer.get("window") if window is None else window
        layer = per_layer["layer"]  # i32[] (or int): the row of every stacked parameter here
        live = live_rows(step)  # i32[]: rows past it are padding
        n = c.num_layers if self.stacked else None
        attn = Attention(
            c, dt, self.backend, self.mesh, self.layout, self.stacked, name="self_attn"
        )

        def layer_norm(name):
            return lambda h: norm(c, dt, name, n)(h, layer)

        def mlp(h):
            if c.num_experts and self.stacked:
                row, is_moe = per_layer["mlp_row"], per_layer.get("is_moe")
                experts = self.layout.experts
                return layer_mlp(h, stacks, row, is_moe, c, self.mesh, experts)
            if c.num_experts:  # this layer's own MoE block or dense MLP (Python-known kind)
                return own_mlp(h, per_layer["is_moe"], c, dt, self.mesh, self.layout.experts)
            return MLP(c, dt, self.layout, self.stacked, name="mlp")(h, layer, live, lora)

        if not c.norm_before:  # post-norm (OPT-350m)
            h, kv = attn(x, rotary, kv, layer, window, step, live, lora)
            x = layer_norm("input_layernorm")(x + h)
            x = layer_norm("post_attention_layernorm")(x + mlp(x))
            return (x, kv), None
        h = layer_norm("input_layernorm")(x)
        h, kv = attn(h, rotary, kv, layer, window, step, live, lora)
        if c.sandwich_norms:  # Gemma: the attention output is normed before the residual
            h = layer_norm("post_attention_layernorm")(h)
        x = x + h
        pre_mlp = "pre_feedforward_layernorm" if c.sandwich_norms else "post_attention_layernorm"
        h = mlp(layer_norm(pre_mlp)(x))
        if c.sandwich_norms:
            h = layer_norm("post_feedforward_layernorm")(h)
        return (x + h, kv), None


def layer_data(config: ModelConfig, layer: int) -> dict:
    """``per_layer_data``'s row ``layer`` as Python values, for an unrolled layer: its index,
    window (0: global), rope table and MLP kind, all static."""
    c = config
    data = {"layer": layer, "window": int(c.layer_windows[layer])}
    if c.rope_local_theta is not None:
        data["rope"] = int(c.local_rope_layers[layer])
    if c.num_experts:
        data["is_moe"] = bool(c.moe_layers[layer])
    return data


def per_layer_data(config: ModelConfig) -> dict[str, np.ndarray]:
    """What differs between layers, as arrays with a leading layer axis (scanned)."""
    c = config
    data = {"layer": np.arange(c.num_layers, dtype=np.int32)}
    if static_window(c) is None and any(c.layer_windows):
        data["window"] = np.asarray(c.layer_windows, np.int32)
    if c.rope_local_theta is not None:
        data["rope"] = np.asarray(c.local_rope_layers, np.int32)
    if c.num_experts:
        data["mlp_row"] = np.asarray([c.mlp_stack_row(i)[1] for i in range(c.num_layers)], np.int32)
        if len(set(c.moe_layers)) > 1:
            data["is_moe"] = np.asarray(c.moe_layers)
    return data


class DecoderModel(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    backend: pallas_kernels.AttentionBackend = pallas_kernels.ReferenceBackend()
    mesh: Mesh | None = None  # tensor parallelism by heads (models/sharding.py)
    # "scan" over stacked parameters, or "unrolled" over one tree per layer (models/layer_loop.py)
    layer_loop: str = "scan"
    # Each Dense's linear method and the table's, chosen at load (models/linear.py)
    layout: WeightLayout = WeightLayout()

    @nn.compact
    def __call__(
        self,
        kv_pool: KVPool | None,
        step: StepInput | None,
        lora: LoRABatch | None = None,
        *,
        hidden_rows: jax.Array | None = None,
        return_hidden: bool = False,
    ):
        """(logits f32[num_logits, vocab], kv_pool), and with ``return_hidden`` the last layer's
        output of every token row, [num_tokens, hidden] before the final norm. Given
        ``hidden_rows`` (such rows), the head alone: their logits."""
        c, dt = self.config, self.dtype
        embed = Embed(c.vocab_size, c.embed_dim, dt, self.layout.table, name="embed_tokens")
        if hidden_rows is not None:
            return self._head(embed, hidden_rows)
        x = embed(step.token_ids)  # [num_tokens, embed_dim]
        if c.word_embed_proj_dim:
            x = self._dense(c.hidden_size, "project_in")(x)
        if c.embed_scale:  # sqrt(hidden) rounded to the compute dtype, as HF
            x = x * jnp.asarray(math.sqrt(c.hidden_size), dt)
        cos = sin = None
        if c.learned_positions:  # OPT: rows 0 and 1 of the table are never used (offset 2)
            positions = nn.Embed(
                c.max_position_embeddings + 2,
                c.hidden_size,
                dtype=dt,
                param_dtype=dt,
                name="embed_positions",
            )
            x = x + positions(step.positions + 2)
        else:
            cos, sin = rope_tables(c, step, dt)
        run = _unrolled_layers if self.layer_loop == "unrolled" else _scanned_layers
        hidden, kv_pool = run(self, x, tuple(kv_pool), cos, sin, step, lora)
        logits = self._head(embed, hidden[step.logits_indices])
        return (logits, kv_pool, hidden) if return_hidden else (logits, kv_pool)

    def _head(self, embed: Embed, x: jax.Array) -> jax.Array:
        """The logits f32[rows, vocab] of rows of the last layer's output."""
        c, dt = self.config, self.dtype
        if c.final_norm:
            x = norm(c, dt, "norm")(x)
        if c.word_embed_proj_dim:
            x = self._dense(c.embed_dim, "project_out")(x)
        if c.tie_word_embeddings:  # x @ table.T, by the table's method
            logits = embed.attend(x)
        else:
            logits = self._dense(c.vocab_size, "lm_head")(x)
        if self.mesh is not None:
            # The head is split by vocabulary: each device computes its columns of the logits,
            # then the rows are gathered (not the head's weights) so every device has them whole.
            if c.vocab_size % self.mesh.shape[AXIS] == 0:
                logits = _constrain(logits, self.mesh, P(None, AXIS))
            logits = _constrain(logits, self.mesh, P())
        logits = logits.astype(jnp.float32)  # [num_logits, vocab]
        if c.final_soft_cap:
            logits = c.final_soft_cap * jnp.tanh(logits / c.final_soft_cap)
        return logits

    def _dense(self, features: int, name: str) -> nn.Module:
        return dense(features, False, self.dtype, name, method=self.layout.linear(name))


def _scanned_layers(model: DecoderModel, x, kv_pool, cos, sin, step: StepInput, lora=None):
    """The layers under ``nn.scan``. Their parameters are created stacked ([num_layers, ...],
    as nn.scan's variable_axes would stack them) and broadcast into the scan, each layer reading
    its row: a sliced scan input would be copied out of the stack before every dot on a CPU."""
    c, dt = model.config, model.dtype
    stacks = mlp_stacks(c, dt) if c.num_experts else None
    layers = nn.scan(
        DecoderLayer,
        variable_broadcast="params",
        split_rngs={"params": False},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        length=c.num_layers,
    )(c, dt, model.backend, model.mesh, model.layout, name="layers")
    data = jax.tree.map(jnp.asarray, per_layer_data(c))
    (x, kv_pool), _ = layers((x, kv_pool), data, cos, sin, step, stacks, lora)
    return x, kv_pool


def _unrolled_layers(model: DecoderModel, x, kv_pool, cos, sin, step: StepInput, lora=None):
    """The layers one after another, each over its own parameters (``layers_{i}``): every
    kernel is a whole array the dot reads where it lies, with no slice of a stack to copy.

    Each layer is a call of one jitted layer function (``decoder_layer``) on its own parameter
    tree, with its index a traced argument (it only offsets the layer's pages in the one pool,
    as the scan's does) and ``layer_data``'s other values static: the layer is traced and
    lowered once per distinct kind (one for most models, two for alternating windows), not once
    per layer, which was most of a step program's tracing at 30 layers. XLA inlines the calls and
    folds each index: the compiled program is the one the layers traced one by one gave."""
    c = model.config
    if model.is_initializing():  # the parameters are created by tracing every layer
        return _layers_one_by_one(model, x, kv_pool, cos, sin, step, lora)
    params = model.variables["params"]
    module = DecoderLayer(
        c, model.dtype, model.backend, model.mesh, model.layout, False, parent=None
    )
    kinds: dict[tuple, object] = {}  # a layer kind (its static data) -> its jitted function
    for i in range(c.num_layers):
        kind = tuple(sorted((k, v) for k, v in layer_data(c, i).items() if k != "layer"))
        if kind not in kinds:
            kinds[kind] = jax.jit(functools.partial(decoder_layer, module, dict(kind)))
        args = ((x, kv_pool), np.int32(i), (cos, sin), step, lora)
        x, kv_pool = kinds[kind](params[f"layers_{i}"], *args)
    return x, kv_pool


def _layers_one_by_one(model: DecoderModel, x, kv_pool, cos, sin, step: StepInput, lora=None):
    """Each unrolled layer traced as a submodule of its own (``layers_{i}``)."""
    c = model.config
    for i in range(c.num_layers):
        layer = DecoderLayer(
            c, model.dtype, model.backend, model.mesh, model.layout, False, name=f"layers_{i}"
        )
        (x, kv_pool), _ = layer((x, kv_pool), layer_data(c, i), cos, sin, step, None, lora)
    return x, kv_pool


def decoder_layer(module: DecoderLayer, data: dict, params, carry, layer, rotary, step, lora):
    """One unrolled layer (``module``, unbound) over its parameters: ``carry`` ``(x, kv_pool)``
    after it; ``data``: the layer's static ``layer_data`` but its index, ``layer`` (i32[]);
    ``rotary``: (cos, sin), each None without rotary embeddings."""
    per_layer = {**data, "layer": layer}
    (x, kv_pool), _ = module.apply({"params": params}, carry, per_layer, *rotary, step, None, lora)
    return x, kv_pool


def _constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
