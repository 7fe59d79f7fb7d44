"""Tensor parallelism by attention heads (Megatron-style) on a one-axis ``"tp"`` mesh.

q/k/v projections are split by heads (columns), the output projection by rows; MLP gate/up by
columns and down by rows (a MoE's experts alike: each expert's intermediate dimension is split;
the router is replicated); the embedding and the LM head by vocabulary (vLLM's
VocabParallelEmbedding and ParallelLMHead: a lookup becomes a masked lookup plus one all-reduce,
and the sampler gathers its rows of logits); norms are replicated. A dimension that the degree
does not divide stays replicated. The KV pool is split on its kv-head axis, so each device holds
its heads' slice of every block. When the degree exceeds num_kv_heads, KV heads are replicated
(as vLLM does) so each device has one. Per-layer parameters are stacked (``layers/...``, and a
MoE family's ``moe/...`` and ``dense_mlp/...``, leading layer axis): their specs gain an unsplit
leading dimension. Split per layer (models/layer_loop.py: ``layers`` a tuple of trees), each
layer's arrays take one layer's specs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ModelConfig

AXIS = "tp"
# [num_kv_heads, num_layers * num_blocks, block_size, head_dim]
POOL_SPEC = P(AXIS, None, None, None)
# An 8-bit pool's scales, f32[num_kv_heads, num_layers * num_blocks, block_size]: split by kv
# heads like the pages, so each device holds the scales of its own heads
SCALES_SPEC = P(AXIS, None, None)

# Parameter path suffix -> partition spec of one layer's array (Dense kernels are [in, out];
# experts [experts, in, out]).
_RULES = {
    ("embed_tokens", "embedding"): P(AXIS, None),  # [vocab, embed]; tied: also the LM head
    ("lm_head", "kernel"): P(None, AXIS),  # [embed, vocab]
    ("q_proj", "kernel"): P(None, AXIS),
    ("k_proj", "kernel"): P(None, AXIS),
    ("v_proj", "kernel"): P(None, AXIS),
    ("q_proj", "bias"): P(AXIS),
    ("k_proj", "bias"): P(AXIS),
    ("v_proj", "bias"): P(AXIS),
    ("o_proj", "kernel"): P(AXIS, None),
    ("gate_proj", "kernel"): P(None, AXIS),  # the MLP, a MoE's shared expert, dense_mlp
    ("up_proj", "kernel"): P(None, AXIS),
    ("gate_proj", "bias"): P(AXIS),
    ("up_proj", "bias"): P(AXIS),
    ("down_proj", "kernel"): P(AXIS, None),
    # Experts: each expert's intermediate dimension is split (models/moe.py says why).
    ("experts", "gate_proj"): P(None, None, AXIS),
    ("experts", "up_proj"): P(None, None, AXIS),
    ("experts", "down_proj"): P(None, AXIS, None),
}
# Top-level parameter trees stacked over layers (leading axis unsplit).
STACKED = ("layers", "moe", "dense_mlp")


def make_mesh(tensor_parallel_size: int) -> Mesh:
    devices = jax.devices()
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
            f"{len(devices)} are visible ({devices[0].platform})"
        )
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (AXIS,))


def tensor_parallel_mesh(tensor_parallel_size: int) -> Mesh | None:
    """The mesh to split a model over, or None for one device. In a multi-process run the mesh
    spans the devices of every process."""
    if jax.process_count() > 1 and tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must equal the {jax.device_count()} "
            f"devices of all {jax.process_count()} processes in a multi-process run"
        )
    return make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None


def min_over_processes(value: int) -> int:
    """The smallest of every process's ``value`` (each process calls this)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def sharded_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config each device computes with: KV heads replicated up to ``tp`` when fewer."""
    if config.num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_heads={config.num_heads} "
            f"(attention is split by heads)"
        )
    sizes = {"intermediate_size": config.intermediate_size if not all(config.moe_layers) else 0}
    if config.num_experts:  # experts are split by their intermediate dimension (shard_map)
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
        sizes["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {name}={size}")
    if config.num_kv_heads % tp == 0:
        return config
    if tp % config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_kv_heads={config.num_kv_heads} or be a "
            "multiple of it (KV heads are then replicated)"
        )
    return dataclasses.replace(config, num_kv_heads=tp)


def replicate_kv_heads(params: dict, config: ModelConfig, tp: int) -> dict:
    """Repeat each KV head's k/v projection columns so that there are ``tp`` KV heads."""
    if config.num_kv_heads >= tp:
        return params
    repeat = tp // config.num_kv_heads
    hd = config.head_dim

    def widen(x):  # [..., num_kv_heads * head_dim] -> [..., tp * head_dim]
        heads = x.reshape(*x.shape[:-1], config.num_kv_heads, hd)
        return jnp.repeat(heads, repeat, axis=-2).reshape(*x.shape[:-1], tp * hd)

    layers = params["layers"]  # stacked: [num_layers, ...]
    attn = dict(layers["self_attn"])
    for proj in ("k_proj", "v_proj"):
        attn[proj] = {k: widen(v) for k, v in attn[proj].items()}
    return {**params, "layers": {**layers, "self_attn": attn}}


def param_shardings(params: dict, mesh: Mesh) -> dict:
    """A NamedSharding for every parameter (or ShapeDtypeStruct): replicated unless a rule
    splits it and the split dimension divides evenly."""
    tp = mesh.shape[AXIS]

    def sharding(path, x):
        keys = tuple(getattr(p, "key", str(p)) for p in path)
        # A per-layer tree's layer i sits at ("layers", SequenceKey(i), ...): not stacked.
        stacked = keys[0] in STACKED and isinstance(path[1], jax.tree_util.DictKey)
        spec = _RULES.get(keys[-2:], P())
        if keys[-1] == "kernel_scale":  # a quantized kernel's scales (models/quant.py)
            spec = _scale_spec(_RULES.get((keys[-2], "kernel"), P()), x.ndim - stacked)
        if stacked and spec != P():
            spec = P(None, *spec)  # the stacked layer axis stays whole
        if any(axis and dim % tp for axis, dim in zip(spec, x.shape, strict=False)):
            spec = P()
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, params)


def _scale_spec(kernel_spec: P, ndim: int) -> P:
    """Scales per output channel ([out]) split like the kernel's output axis; grouped scales
    ([in / g, out]) like the kernel itself."""
    spec = kernel_spec if ndim == 2 else P(*tuple(kernel_spec)[1:])
    return spec if any(spec) else P()


def shard_params(params: dict, mesh: Mesh) -> dict:
    """Place parameters on the mesh; each device receives only its slices."""
    return jax.tree.map(jax.device_put, params, param_shardings(params, mesh))


def pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, POOL_SPEC)


def pool_specs(quantized: bool) -> tuple[P, ...]:
    """The pool tuple's specs: (k_pages, v_pages), plus (k_scales, v_scales) when 8-bit."""
    return (POOL_SPEC,) * 2 + ((SCALES_SPEC,) * 2 if quantized else ())


def scales_sharding(pages_sharding):
    """The scales' placement beside pages placed by ``pages_sharding`` (one device, or split by
    kv heads on a mesh)."""
    if isinstance(pages_sharding, NamedSharding):
        return NamedSharding(pages_sharding.mesh, SCALES_SPEC)
    return pages_sharding
