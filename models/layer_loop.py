"""How the step runs its layers, chosen once at load: ``"scan"`` over stacked parameters or
``"unrolled"`` over one parameter tree per layer.

Checkpoints, the parameter cache and ``param_shapes`` hold the layers stacked
(``params["layers"]``, leading axis ``num_layers``; a MoE family's MLPs under ``"moe"`` and
``"dense_mlp"``, stacked over the layers of each kind). ``split_layers`` turns that tree into the
per-layer one after loading (vLLM's ``process_weights_after_loading``): ``params["layers"]`` a
tuple of ``num_layers`` trees, layer ``i``'s holding row ``i`` of every stacked array, and a MoE
family's layer also its row of ``moe`` or ``dense_mlp`` under that name. ``forward`` takes either
tree and runs the loop its structure says (models/decoder.py).

Why two loops: on an H200 (bf16, 8 layers at Llama-3-8B sizes) XLA:GPU compiled the scan over
stacked weights with a ``dynamic-slice`` fusion producing each layer's whole ``bf16[1,14336,4096]``
slice before its GEMM: 0.39-0.40 of the memory floor, against 0.99-1.15 for the same layers
unrolled over one array per layer. On a CPU the native kernels read the stack in place
(pallas_kernels/layer_matmul.py) and the scan keeps one copy of the layer in the program, so
compiles stay short: the CPU keeps the scan, every other platform unrolls.
"""

from __future__ import annotations

import os

import jax

LAYER_LOOPS = ("scan", "unrolled")
ENV_LAYER_LOOP = "PAGEDJAX_LAYER_LOOP"  # forces one of LAYER_LOOPS on any platform
_MLP_STACKS = ("moe", "dense_mlp")


def check_layer_loop(layer_loop: str) -> str:
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    return layer_loop


def default_layer_loop() -> str:
    """``$PAGEDJAX_LAYER_LOOP`` when set, else "scan" on a CPU and "unrolled" elsewhere."""
    forced = os.environ.get(ENV_LAYER_LOOP, "").strip().lower()
    if forced:
        return check_layer_loop(forced)
    return "scan" if jax.default_backend() == "cpu" else "unrolled"


def is_per_layer(params) -> bool:
    """Whether ``params`` holds one tree per layer (``split_layers``'s output)."""
    return isinstance(params.get("layers"), (tuple, list))


def layer_params(params, layer: int) -> dict:
    """Layer ``layer``'s parameters as one layer's tree (rows of the stack, or its own tree)."""
    if is_per_layer(params):
        return params["layers"][layer]
    return jax.tree.map(lambda a: a[layer], params["layers"])


def split_layers(params, config) -> dict:
    """The stacked tree as one tree per layer (see the module's docstring); a per-layer tree
    comes back as it is. Each layer's arrays are new buffers (rows copied out of the stacks);
    ShapeDtypeStructs split into one layer's shapes."""
    if is_per_layer(params):
        return params
    rows_of = jax.jit(lambda a: tuple(a[i] for i in range(a.shape[0])))

    def unstack(a):  # ShapeDtypeStructs (param_shapes) split to one layer's shapes
        if isinstance(a, jax.ShapeDtypeStruct):
            return (jax.ShapeDtypeStruct(a.shape[1:], a.dtype),) * a.shape[0]
        return rows_of(a)

    rows = {
        name: jax.tree.map(unstack, params[name])
        for name in ("layers", *_MLP_STACKS)
        if name in params
    }
    per_layer = []
    for i in range(config.num_layers):
        tree = _row(rows["layers"], i)
        if config.num_experts:
            stack, row = config.mlp_stack_row(i)
            tree = {**tree, stack: _row(rows[stack], row)}
        per_layer.append(tree)
    rest = {k: v for k, v in params.items() if k not in ("layers", *_MLP_STACKS)}
    return {**rest, "layers": tuple(per_layer)}


def _row(rows, i: int):
    """Row ``i`` of a tree whose leaves are tuples of rows."""
    return jax.tree.map(lambda r: r[i], rows, is_leaf=lambda x: isinstance(x, tuple))


def flax_tree(params) -> dict:
    """The tree Flax applies: a per-layer tree's layers named ``layers_{i}`` (the decoder's
    submodules); a stacked tree as it is."""
    if not is_per_layer(params):
        return params
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, **{f"layers_{i}": p for i, p in enumerate(params["layers"])}}
