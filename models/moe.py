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
from .linear import GroupedExpertsLinear
from .sharding import AXIS

_INIT = nn.initializers.normal(0.02)
GROUPED_EXPERTS = GroupedExpertsLinear()


class _Params(nn.Module):
    """A named group of parameters with the given shapes (stacked: leading axis = layers), and
    the ``{name}_scale`` of each one that is quantized (models/quant.py)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> dict:
        out = {name: self.param(name, _INIT, shape, self.dtype) for name, shape in self.shapes}
        for name, _ in self.shapes:
            if self.has_variable("params", f"{name}_scale"):
                out[f"{name}_scale"] = self.get_variable("params", f"{name}_scale")
        return out


class _GatedMLPParams(nn.Module):
    """Stacked gated-MLP parameters: {gate,up,down}_proj/kernel, [n, in, out] ([in, out] when
    ``n`` is None: one layer's)."""

    n: int | None
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
        lead = () if self.n is None else (self.n,)
        return {
            proj: _Params((("kernel", (*lead, *shape)),), self.dtype, name=proj)()
            for proj, shape in shapes.items()
        }


class MoEParams(nn.Module):
    """The MoE blocks of ``n`` layers, stacked: router, experts (one array per projection, with
    an expert axis), and Qwen2-MoE's shared expert and its gate. ``n`` None: one layer's."""

    config: ModelConfig
    dtype: jnp.dtype
    n: int | None

    @nn.compact
    def __call__(self) -> dict:
        c, dt, n = self.config, self.dtype, self.n
        h, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
        lead = () if n is None else (n,)
        experts = (
            ("gate_proj", (*lead, e, h, i)),  # [layers, experts, in, out]
            ("up_proj", (*lead, e, h, i)),
            ("down_proj", (*lead, e, i, h)),
        )
        p = {
            "router": _Params((("kernel", (*lead, h, e)),), dt, name="router")(),
            "experts": _Params(experts, dt, name="experts")(),
        }
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            p["shared_expert"] = _GatedMLPParams(n, h, s, dt, name="shared_expert")()
            gate = (("kernel", (*lead, h, 1)),)
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


def _grouped_experts(x, top_idx, top_w, weights, act, scales, method):
    """sum_k top_w[t, k] * expert_{top_idx[t, k]}(x[t]) as three grouped matmuls.

    x: [num_tokens, hidden]; top_idx i32 / top_w f32: [num_tokens, k]; ``weights``: gate_w and
    up_w [experts, hidden, inner], down_w [experts, inner, hidden]. Returns f32[num_tokens,
    hidden].
    ``scales``: None, or the 8-bit kernels' per-output-channel scales (gate, up: f32[experts,
    inner]; down: f32[experts, hidden]; models/quant.py): the kernels are converted to the
    compute dtype inside the matmul and each row's output multiplied by its expert's scales.
    ``method``: the experts' linear method (models/linear.py ``GroupedExpertsLinear``).
    """
    gate_w, up_w, down_w = weights
    num_tokens, k = top_idx.shape
    experts = gate_w.shape[0]
    flat = top_idx.reshape(-1)  # i32[num_tokens * k]
    order = jnp.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    rows = order // k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)  # i32[experts]
    xs = x[rows]  # [num_tokens * k, hidden]
    row_expert = flat[order]  # i32[num_tokens * k]: the expert of each sorted row
    gate_s, up_s, down_s = scales if scales is not None else (None, None, None)

    def matmul(a, w, scale):  # a: [num_tokens * k, in]; w: [experts, in, out]
        return method.apply(a, w, sizes, scale, row_expert)

    h = act(matmul(xs, gate_w, gate_s)) * matmul(xs, up_w, up_s)
    y = matmul(h, down_w, down_s)  # [num_tokens * k, hidden]
    y = y.astype(jnp.float32) * top_w.reshape(-1)[order][:, None]
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[rows].add(y)


def moe_mlp(
    x: jax.Array, p: dict, config: ModelConfig, mesh: Mesh | None, experts=GROUPED_EXPERTS
) -> jax.Array:
    """One layer's MoE block. x: [num_tokens, hidden]; ``p`` is the layer's row of ``moe``;
    ``experts``: the experts' linear method, chosen at load (models/linear.py)."""
    c = config
    act = activation(c)
    logits = x @ p["router"]["kernel"]  # [num_tokens, experts]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_idx = jax.lax.top_k(probs, c.num_experts_per_tok)  # [num_tokens, k]
    if c.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    ex = p["experts"]
    names = ("gate_proj", "up_proj", "down_proj")
    weights = tuple(ex[n] for n in names)
    scales = tuple(ex[f"{n}_scale"] for n in names) if "gate_proj_scale" in ex else ()
    if mesh is None:
        out = _grouped_experts(x, top_idx, top_w, weights, act, scales or None, experts)
    else:
        # Each device holds a slice of EVERY expert's intermediate dimension (column-split
        # gate/up, row-split down, as the dense MLP), not whole experts: every device then does
        # an equal share of every token's work whatever the routing (no load imbalance, no
        # all-to-all token dispatch), any number of experts splits over any degree that divides
        # the intermediate size, and the layer costs one all-reduce, like a dense MLP.
        # Quantized: gate/up scales split like their columns, down's (per hidden) whole (a
        # per-column factor commutes with the sum over the devices' partial rows).
        def local(x, top_idx, top_w, gate_w, up_w, down_w, *scales):
            args = ((gate_w, up_w, down_w), act, scales or None, experts)
            part = _grouped_experts(x, top_idx, top_w, *args)
            return jax.lax.psum(part, AXIS)

        col, row = P(None, None, AXIS), P(None, AXIS, None)
        scale_specs = (P(None, AXIS), P(None, AXIS), P()) if scales else ()
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P(), col, col, row, *scale_specs),
            out_specs=P(),
            check_vma=False,
        )(x, top_idx, top_w, *weights, *scales)
    out = out.astype(x.dtype)
    if c.shared_expert_intermediate_size:
        shared = gated_mlp(x, p["shared_expert"], act)
        out = out + jax.nn.sigmoid(x @ p["shared_expert_gate"]["kernel"]) * shared
    return out


def layer_mlp(
    x: jax.Array, stacks: dict, row, is_moe, config: ModelConfig, mesh, experts=GROUPED_EXPERTS
) -> jax.Array:
    """A MoE family's layer MLP: row ``row`` of its stack; ``is_moe`` (bool[] per-layer data,
    or None when every layer is MoE) picks the stack when the layers mix both kinds."""
    take = lambda tree: jax.tree.map(lambda a: a[row], tree)  # noqa: E731
    moe = lambda x: moe_mlp(x, take(stacks["moe"]), config, mesh, experts)  # noqa: E731
    if "dense_mlp" not in stacks:
        return moe(x)
    dense = lambda x: gated_mlp(x, take(stacks["dense_mlp"]), activation(config))  # noqa: E731
    if "moe" not in stacks:
        return dense(x)
    return jax.lax.cond(is_moe, moe, dense, x)


def own_mlp(
    x: jax.Array, is_moe: bool, config: ModelConfig, dtype, mesh, experts=GROUPED_EXPERTS
) -> jax.Array:
    """An unrolled layer's MLP over its own parameters (``moe`` or ``dense_mlp``, one layer's
    row of the stacks; models/layer_loop.py): the kind is known in Python, so no cond."""
    c = config
    if is_moe:
        return moe_mlp(x, MoEParams(c, dtype, None, name="moe")(), c, mesh, experts)
    p = _GatedMLPParams(None, c.hidden_size, c.intermediate_size, dtype, name="dense_mlp")()
    return gated_mlp(x, p, activation(c))
