"""Linear methods: how a linear layer's weights are laid out and multiplied, chosen once at load
(vLLM's ``LinearMethodBase`` and ``process_weights_after_loading``).

A linear method is a hashable object with
- ``kernel_shape(n_in, n_out, lead)``: the kernel's shape as the method holds it (``lead``: the
  stacked layer axis under the scan, or ``()``);
- ``accepts(weights)``: whether it can hold a Dense's weights as loaded (``{"kernel": ...}``,
  plus ``"kernel_scale"`` when quantized, models/quant.py);
- ``process_weights_after_loading(weights)``: the weights in its layout;
- ``apply(x, weights, layer, live_rows)``: ``x @ kernel`` (of layer ``layer`` when stacked;
  rows past ``live_rows`` are padding).
A table method (an embedding, and the tied LM head) has ``table_shape``, ``accepts``,
``process_weights_after_loading``, ``lookup(table, ids)`` and ``attend(x, table)``.

Here: XLA's float dot, weight-only 8-bit kernels with a scale per output column (int8 / fp8) or
per group of inputs (int8-g32 / g64), XLA's table, and a MoE block's experts as one grouped
matmul (``apply(rows, kernels, group_sizes, scale, row_expert)``). A platform may offer its own
methods for the stacked layers under the scan (the CPU's native ones:
pallas_kernels/layer_matmul.py ``CpuLinearMethods``), passed in by the caller; models/ knows
them only through this interface.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..pallas_kernels.row_major_table import RowMajorTable
from . import quant
from .config import ModelConfig
from .layer_loop import check_layer_loop, default_layer_loop, is_per_layer, split_layers
from .sharding import shard_params

_DOT = (((1,), (0,)), ((), ()))


def _row(a: jax.Array, layer) -> jax.Array:
    return a if layer is None else a[layer]


@dataclasses.dataclass(frozen=True)
class XlaLinear:
    """A float kernel [in, out] (stacked: [L, in, out], row ``layer`` taken) by XLA's dot."""

    def kernel_shape(self, n_in: int, n_out: int, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, n_in, n_out)

    def accepts(self, weights: dict) -> bool:
        return quant.SCALE not in weights

    def process_weights_after_loading(self, weights: dict) -> dict:
        return weights

    def apply(self, x, weights: dict, layer=None, live_rows=None) -> jax.Array:
        kernel = _row(weights["kernel"], layer)
        return jax.lax.dot_general(x, kernel.astype(x.dtype), _DOT)


@dataclasses.dataclass(frozen=True)
class ColumnQuantLinear(XlaLinear):
    """An 8-bit kernel (int8 / fp8) and a scale per output column ([out]): converted to x's
    dtype inside the dot, each output column multiplied by its scale after it."""

    def accepts(self, weights: dict) -> bool:
        scale = weights.get(quant.SCALE)
        return scale is not None and scale.ndim < weights["kernel"].ndim

    def apply(self, x, weights: dict, layer=None, live_rows=None) -> jax.Array:
        y = super().apply(x, weights, layer)
        return y * _row(weights[quant.SCALE], layer).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class GroupedQuantLinear(XlaLinear):
    """An int8 kernel with a scale per group of inputs of each column ([in / g, out]; "int8-g32"
    and GGUF Q8_0, "int8-g64"): dequantized group by group, then the dot."""

    def accepts(self, weights: dict) -> bool:
        scale = weights.get(quant.SCALE)
        return scale is not None and scale.ndim == weights["kernel"].ndim

    def apply(self, x, weights: dict, layer=None, live_rows=None) -> jax.Array:
        kernel = _row(weights["kernel"], layer)
        kernel = quant.dequantize(kernel, _row(weights[quant.SCALE], layer), x.dtype)
        return jax.lax.dot_general(x, kernel, _DOT)


@dataclasses.dataclass(frozen=True)
class XlaTable(RowMajorTable):
    """An embedding table [N, K]: ``jnp.take`` and the tied head ``x @ table.T`` by XLA's dot
    (f32 accumulation, x's dtype)."""

    def attend(self, x: jax.Array, table: jax.Array) -> jax.Array:
        dims = (((1,), (1,)), ((), ()))
        y = jax.lax.dot_general(x, table.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return y.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class GroupedExpertsLinear:
    """A MoE block's experts as one grouped matmul over rows sorted by expert
    (``jax.lax.ragged_dot``): kernels [experts, in, out], float, or 8-bit with a scale per
    output column of each expert ([experts, out]) applied to each row by its expert."""

    def apply(self, a, kernels, group_sizes, scale=None, row_expert=None) -> jax.Array:
        y = jax.lax.ragged_dot(a, kernels.astype(a.dtype), group_sizes)
        return y if scale is None else y * scale[row_expert].astype(y.dtype)


XLA_LINEAR = XlaLinear()
_QUANTIZED = (ColumnQuantLinear(), GroupedQuantLinear())
# A Dense's path in the parameter tree, as WeightLayout names it: "self_attn/q_proj" for a
# layer's projection, "lm_head" / "project_in" / "project_out" at the top.
LAYER_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
TOP_LEVEL = ("lm_head", "project_in", "project_out")


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """The linear methods a model's weights were processed for (static: ``forward``'s
    ``layout``): one per Dense path, XLA's float dot for any path not named, and the table's."""

    methods: tuple[tuple[str, object], ...] = ()
    table: object = XlaTable()
    experts: object = GroupedExpertsLinear()  # a MoE family's experts (models/moe.py)

    def linear(self, path: str):
        return dict(self.methods).get(path, XlaLinear())


def _own_method(weights: dict):
    """The method this module offers for a Dense's weights as loaded: quantized or float."""
    return next((m for m in _QUANTIZED if m.accepts(weights)), XlaLinear())


def _dense_weights(params: dict) -> dict[str, dict]:
    """path -> a Dense's weights (kernel and scale, no bias) in a stacked tree."""
    found = {}
    layers = params.get("layers", {})
    for group, names in LAYER_PROJECTIONS.items():
        for name in names:
            if name in layers.get(group, {}):
                found[f"{group}/{name}"] = _kernel_weights(layers[group][name])
    for name in TOP_LEVEL:
        if name in params:
            found[name] = _kernel_weights(params[name])
    return found


def _kernel_weights(p: dict) -> dict:
    return {k: v for k, v in p.items() if k in ("kernel", quant.SCALE)}


def choose_layout(
    params: dict, config: ModelConfig, platform=None, stacked: bool = True
) -> WeightLayout:
    """Each Dense's method for a stacked tree (or one layer's, ``stacked`` off): its quantized
    or float method, and the stacked layers' projections the ``platform``'s
    (``choose(projections, tied_table) -> (layers' method, table's method)``, either None for
    ours) where it offers one."""
    weights = _dense_weights(params)
    methods = {path: _own_method(w) for path, w in weights.items()}
    table = XlaTable()
    if platform is not None:
        layer_paths = [p for p in weights if "/" in p] if stacked else []
        tied = params["embed_tokens"]["embedding"] if config.tie_word_embeddings else None
        layers_method, table_method = platform.choose([weights[p] for p in layer_paths], tied)
        if layers_method is not None:
            methods.update(dict.fromkeys(layer_paths, layers_method))
        table = table_method or table
    return WeightLayout(tuple(sorted(methods.items())), table)


def apply_layout(params: dict, layout: WeightLayout) -> dict:
    """``params`` (stacked) with every Dense's weights and the table processed by their
    methods."""
    out = dict(params)
    if "layers" in params:
        out["layers"] = {k: dict(v) for k, v in params["layers"].items()}
    for path in _dense_weights(params):
        *group, name = path.split("/")
        parent = out["layers"][group[0]] if group else out
        weights = parent[name]
        kernel = _kernel_weights(weights)
        processed = layout.linear(path).process_weights_after_loading(kernel)
        parent[name] = {**weights, **processed}
    return _process_table(out, layout)


def _process_table(params: dict, layout: WeightLayout) -> dict:
    embed = params["embed_tokens"]
    table = layout.table.process_weights_after_loading(embed["embedding"])
    return {**params, "embed_tokens": {**embed, "embedding": table}}


def process_weights_after_loading(
    params,
    config: ModelConfig,
    mesh: Mesh | None = None,
    layer_loop: str | None = None,
    platform=None,
) -> tuple[dict, WeightLayout]:
    """The loaded (stacked) parameters in the layout the step reads, and that layout
    (``forward``'s ``layout``). ``layer_loop`` (default ``default_layer_loop()``): "unrolled"
    splits the layers into one tree per layer (``split_layers``; placed by ``param_shardings``
    on a mesh); "scan" keeps them stacked, their projections in the ``platform``'s methods
    where it offers them (never on a mesh: sharded kernels take XLA's dot)."""
    loop = check_layer_loop(layer_loop) if layer_loop else default_layer_loop()
    if loop == "scan" and is_per_layer(params):
        raise ValueError("layer_loop='scan' needs stacked parameters, got one tree per layer")
    platform = platform if mesh is None else None
    if loop == "scan":
        layout = choose_layout(params, config, platform)
        return apply_layout(params, layout), layout
    # Unrolled: the layers' methods are this module's, over whole per-layer arrays.
    params = split_layers(params, config)
    one_layer = {**params, "layers": params["layers"][0]}  # one layer's paths and weights
    layout = choose_layout(one_layer, config, platform, stacked=False)
    params = _process_table(params, layout)
    return (params if mesh is None else shard_params(params, mesh)), layout
