"""Weight-only quantization of the linear layers: int8 or float8_e4m3fn kernels with symmetric
per-output-channel scales, quantized once at load and dequantized on the fly inside the step.

A quantized Dense keeps its ``kernel`` name, now in 8 bits, and gains ``kernel_scale``
(float32, the kernel's shape without its input axis: ``[out]``, or ``[num_layers, out]`` when
stacked). ``models.layers.Dense`` multiplies by the scale when its parameters hold one, so the
same model code serves quantized and unquantized trees: ``x @ kernel.astype(dtype) * scale``
(XLA fuses the convert into the dot; the scale is per output column, so it applies after it).
"int8-g64" / "int8-g32" keep a scale per 64 / 32 inputs of each column (``[..., in / g, out]``;
per channel where g does not divide the inputs): the kernel is dequantized group by group inside
the step, then the dot. On SmolLM2-135M per-channel int8 agrees with float32 on 0.96 of greedy
next tokens, groups of 64 on 0.99 (docs/BENCHMARKS.md, "Quantization"). A GGUF Q8_0 file's
kernels load straight into the "int8-g32" layout with the file's own scales (models/loader.py).

What is quantized: every Dense kernel under ``layers`` (attention and a dense MLP), an untied LM
head, OPT's embedding projections, and a MoE family's experts (``moe/experts/{gate,up,down}_proj``,
[layers, experts, in, out]: always a scale per output channel, ``{name}_scale`` [layers, experts,
out], applied after the grouped matmul; models/moe.py). What stays in the compute dtype:
embeddings (so a tied LM head too), norms, biases, the router, Qwen2-MoE's shared expert and a
MoE family's ``dense_mlp`` stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

QUANTIZATIONS = ("int8", "fp8", "int8-g64", "int8-g32")
# A GGUF Q8_0 tensor is blocks of 32 int8 values along the input axis with a float16 scale each:
# the layout of "int8-g32", which such a file's linear kernels load as (models/loader.py).
GGUF_Q8_0 = "int8-g32"
_QMAX = {"int8": 127.0, "fp8": 448.0}  # float8_e4m3fn's largest finite value
_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# "int8-g64": a scale per 64 inputs of each output column ([..., in / 64, out]), where 64 divides
# the kernel's inputs (else per channel).
_TOP_LEVEL = ("layers", "lm_head", "project_in", "project_out")
SCALE = "kernel_scale"
LAYOUT = 2  # in the cache key of a quantized tree; bump when what is quantized changes (2: experts)


def check(quantization: str | None) -> str | None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )
    return quantization


def _parse(quantization: str) -> tuple[str, int | None]:
    """ "int8" -> ("int8", None); "int8-g64" -> ("int8", 64)."""
    kind, _, group = quantization.partition("-g")
    return kind, int(group) if group else None


def _group(n_in: int, quantization: str) -> int | None:
    group = _parse(quantization)[1]
    return group if group and n_in % group == 0 else None


def storage_dtype(quantization: str):
    return jnp.dtype(_STORAGE[_parse(quantization)[0]])


def compute_dtype(params: dict):
    """The dtype the model computes in: the embedding's (never quantized)."""
    return params["embed_tokens"]["embedding"].dtype


def _is_expert(path: tuple[str, ...]) -> bool:
    return len(path) == 3 and path[:2] == ("moe", "experts")


def _quantizable(path: tuple[str, ...]) -> bool:
    return (path[-1] == "kernel" and path[0] in _TOP_LEVEL and len(path) >= 2) or _is_expert(path)


def scale_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """Where a quantized kernel's scales live: ``kernel_scale`` beside a Dense kernel,
    ``{name}_scale`` beside an expert stack."""
    return (*path[:-1], SCALE if path[-1] == "kernel" else f"{path[-1]}_scale")


def _method(path: tuple[str, ...], quantization: str) -> str:
    """The experts are quantized per output channel whatever the grouping asked for."""
    return _parse(quantization)[0] if _is_expert(path) else quantization


def quantize_kernel(w: jax.Array, quantization: str) -> tuple[jax.Array, jax.Array]:
    """``w`` [..., in, out] -> (8-bit kernel, f32 scale [..., out], or [..., in / g, out] with
    groups of g inputs) with ``w ~ q * scale``."""
    kind = _parse(quantization)[0]
    *lead, n_in, n_out = w.shape
    grouped = _group(n_in, quantization) is not None
    group = _group(n_in, quantization) or n_in
    wf = w.astype(jnp.float32).reshape(*lead, n_in // group, group, n_out)
    amax = jnp.max(jnp.abs(wf), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / _QMAX[kind], 1.0)
    scaled = wf / scale
    if kind == "int8":
        q = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(scaled, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    scale = scale[..., 0, :]
    return q.reshape(w.shape), scale if grouped else scale[..., 0, :]


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """One kernel [in, out] (or stacked [..., in, out]) in ``dtype``, from its 8-bit values and
    its grouped scale ([..., in / g, out]; a per-channel scale is applied after the dot). The
    product is taken in float32 and rounded once to ``dtype``: exact for an int8 value times a
    float16 scale (GGUF Q8_0), so such a kernel equals the file's dequantized weights in
    ``dtype`` bit for bit."""
    *lead, n_in, n_out = q.shape
    groups = scale.shape[-2]
    w = q.astype(jnp.float32).reshape(*lead, groups, n_in // groups, n_out)
    return (w * scale[..., None, :].astype(jnp.float32)).astype(dtype).reshape(q.shape)


def dequantize_kernel(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    if scale.ndim == q.ndim:
        return dequantize(q.astype(jnp.float32), scale.astype(jnp.float32), jnp.float32).astype(
            dtype
        )
    return (q.astype(jnp.float32) * scale[..., None, :].astype(jnp.float32)).astype(dtype)


def quantize_params(params: dict, quantization: str | None, mesh=None) -> dict:
    """The tree with its linear kernels quantized (None: unchanged). With a ``mesh``, each
    quantized kernel and scale is placed as ``param_shardings`` says (scales split like their
    kernels' output axis)."""
    if check(quantization) is None:
        return params
    flat = flatten_dict(params)
    if any(path[-1].endswith("_scale") for path in flat):
        raise ValueError("parameters are already quantized")
    shardings = None
    if mesh is not None:
        from .sharding import param_shardings

        shardings = flatten_dict(param_shardings(quantized_shapes(params, quantization), mesh))
    out = {}
    for path, w in flat.items():
        if not _quantizable(path):
            out[path] = w
            continue
        scale = scale_path(path)
        fn = _quantizer(_method(path, quantization))
        if shardings is not None:
            fn = jax.jit(fn, out_shardings=(shardings[path], shardings[scale]))
        out[path], out[scale] = fn(w)
    return unflatten_dict(out)


def _quantizer(quantization: str):
    return jax.jit(lambda w: quantize_kernel(w, quantization))


def quantized_shapes(shapes: dict, quantization: str | None) -> dict:
    """``param_shapes``'s tree as it is after ``quantize_params`` (ShapeDtypeStructs)."""
    if check(quantization) is None:
        return shapes
    out = {}
    for path, s in flatten_dict(shapes).items():
        if _quantizable(path):
            out[path] = jax.ShapeDtypeStruct(s.shape, storage_dtype(quantization))
            group = _group(s.shape[-2], _method(path, quantization))
            groups = (s.shape[-2] // group,) if group else ()
            scale_shape = s.shape[:-2] + groups + s.shape[-1:]
            out[scale_path(path)] = jax.ShapeDtypeStruct(scale_shape, jnp.float32)
        else:
            out[path] = s
    return unflatten_dict(out)


def param_bytes(shapes: dict) -> int:
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
