"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax top-k routing, the experts as
one grouped matmul over the tokens sorted by expert, and Qwen2-MoE's sigmoid-gated shared expert.

A MoE family keeps its MLP parameters outside the scanned ``layers`` tree, stacked over the layers
of each kind: ``moe/...`` over its MoE layers and ``dense_mlp/...`` over its dense ones (Qwen-MoE's
``decoder_sparse_step`` / ``mlp_only_layers``), since the two differ in shape. Each scanned layer
takes its row of its stack (per-layer data, not a Python branch per layer).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .layers import activation
from .sharding import AXIS

_INIT = nn.initializers.normal(0.02)


class _Params(nn.Module):
    """A named group of parameters with the given shapes (stacked: leading axis = layers)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> dict:
        return {name: self.param(name, _INIT, shape, self.dtype) for name, shape in self.shapes}


class _GatedMLPParams(nn.Module):
    """Stacked gated-MLP parameters: {gate,up,down}_proj/kernel, [n, in, out]."""

    n: int
    hidden: int
    inner: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> dict:
        shapes = {
            "gate_proj": (self.hidden, self.inner),
            "up_proj": (self.hidden, self.inner),
            "down_proj": (self.inner, self.hidden),
        }
        return {
            proj: _Params((("kernel", (self.n, *shape)),), self.dtype, name=proj)()
            for proj, shape in shapes.items()
        }


class MoEParams(nn.Module):
    """The MoE blocks of ``n`` layers, stacked: router, experts (one array per projection, with
    an expert axis), and Qwen2-MoE's shared expert and its gate."""

    config: ModelConfig
    dtype: jnp.dtype
    n: int

    @nn.compact
    def __call__(self) -> dict:
        c, dt, n = self.config, self.dtype, self.n
        h, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
        experts = (
            ("gate_proj", (n, e, h, i)),  # [layers, experts, in, out]
            ("up_proj", (n, e, h, i)),
            ("down_proj", (n, e, i, h)),
        )
        p = {
            "router": _Params((("kernel", (n, h, e)),), dt, name="router")(),
            "experts": _Params(experts, dt, name="experts")(),
        }
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            p["shared_expert"] = _GatedMLPParams(n, h, s, dt, name="shared_expert")()
            gate = (("kernel", (n, h, 1)),)
            p["shared_expert_gate"] = _Params(gate, dt, name="shared_expert_gate")()
        return p


def mlp_stacks(config: ModelConfig, dtype) -> dict:
    """Create (inside a parent module's compact call) a MoE family's stacked MLP parameters:
    ``{"moe": ..., "dense_mlp": ...}``, either absent when no layer is of that kind."""
    c = config
    n_moe = sum(c.moe_layers)
    n_dense = c.num_layers - n_moe
    stacks = {}
    if n_moe:
        stacks["moe"] = MoEParams(c, dtype, n_moe, name="moe")()
    if n_dense:
        stacks["dense_mlp"] = _GatedMLPParams(
            n_dense, c.hidden_size, c.intermediate_size, dtype, name="dense_mlp"
        )()
    return stacks


def gated_mlp(x: jax.Array, p: dict, act) -> jax.Array:  # x: [num_tokens, hidden]
    gate = x @ p["gate_proj"]["kernel"]
    up = x @ p["up_proj"]["kernel"]
    return (act(gate) * up) @ p["down_proj"]["kernel"]


def _grouped_experts(x, top_idx, top_w, gate_w, up_w, down_w, act):
    """sum_k top_w[t, k] * expert_{top_idx[t, k]}(x[t]) as three grouped matmuls.

    x: [num_tokens, hidden]; top_idx i32 / top_w f32: [num_tokens, k]; gate_w/up_w:
    [experts, hidden, inner]; down_w: [experts, inner, hidden]. Returns f32[num_tokens, hidden].
    """
    num_tokens, k = top_idx.shape
    experts = gate_w.shape[0]
    flat = top_idx.reshape(-1)  # i32[num_tokens * k]
    order = jnp.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    rows = order // k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)  # i32[experts]
    xs = x[rows]  # [num_tokens * k, hidden]
    h = act(jax.lax.ragged_dot(xs, gate_w, sizes)) * jax.lax.ragged_dot(xs, up_w, sizes)
    y = jax.lax.ragged_dot(h, down_w, sizes)  # [num_tokens * k, hidden]
    y = y.astype(jnp.float32) * top_w.reshape(-1)[order][:, None]
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[rows].add(y)


def moe_mlp(x: jax.Array, p: dict, config: ModelConfig, mesh: Mesh | None) -> jax.Array:
    """One layer's MoE block. x: [num_tokens, hidden]; ``p`` is the layer's row of ``moe``."""
    c = config
    act = activation(c)
    logits = x @ p["router"]["kernel"]  # [num_tokens, experts]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_idx = jax.lax.top_k(probs, c.num_experts_per_tok)  # [num_tokens, k]
    if c.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    ex = p["experts"]
    weights = (ex["gate_proj"], ex["up_proj"], ex["down_proj"])
    if mesh is None:
        out = _grouped_experts(x, top_idx, top_w, *weights, act)
    else:
        # Each device holds a slice of EVERY expert's intermediate dimension (column-split
        # gate/up, row-split down, as the dense MLP), not whole experts: every device then does
        # an equal share of every token's work whatever the routing (no load imbalance, no
        # all-to-all token dispatch), any number of experts splits over any degree that divides
        # the intermediate size, and the layer costs one all-reduce, like a dense MLP.
        def local(x, top_idx, top_w, gate_w, up_w, down_w):
            part = _grouped_experts(x, top_idx, top_w, gate_w, up_w, down_w, act)
            return jax.lax.psum(part, AXIS)

        col, row = P(None, None, AXIS), P(None, AXIS, None)
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P(), col, col, row),
            out_specs=P(),
            check_vma=False,
        )(x, top_idx, top_w, *weights)
    out = out.astype(x.dtype)
    if c.shared_expert_intermediate_size:
        shared = gated_mlp(x, p["shared_expert"], act)
        out = out + jax.nn.sigmoid(x @ p["shared_expert_gate"]["kernel"]) * shared
    return out


def layer_mlp(x: jax.Array, stacks: dict, row, is_moe, config: ModelConfig, mesh) -> jax.Array:
    """A MoE family's layer MLP: row ``row`` of its stack; ``is_moe`` (bool[] per-layer data,
    or None when every layer is MoE) picks the stack when the layers mix both kinds."""
    take = lambda tree: jax.tree.map(lambda a: a[row], tree)  # noqa: E731
    moe = lambda x: moe_mlp(x, take(stacks["moe"]), config, mesh)  # noqa: E731
    if "dense_mlp" not in stacks:
        return moe(x)
    dense = lambda x: gated_mlp(x, take(stacks["dense_mlp"]), activation(config))  # noqa: E731
    if "moe" not in stacks:
        return dense(x)
    return jax.lax.cond(is_moe, moe, dense, x)
