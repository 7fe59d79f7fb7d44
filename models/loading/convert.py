"""Checkpoint tensors -> our parameter tree: renamed by a family's weight map, transformed, checked
against the model's parameter shapes, and written into the stacked parameters on device. Our
per-layer names ``layers_{i}/...`` name layer ``i``'s slice of the stacked parameter
``layers/...`` (leading layer axis)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh

from .. import quant
from ..config import ModelConfig
from ..llama import param_shapes
from ..sharding import param_shardings
from ..weight_maps import Transform, WeightMap

_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


# Our stacked names: "layers_{i}/rest", optionally "[e]" (an index into the next axis).
_STACKED_NAME = re.compile(r"layers_(\d+)/(.*?)(?:\[(\d+)\])?")


@dataclasses.dataclass(frozen=True)
class Q8Blocks:
    """A GGUF Q8_0 tensor kept in 8 bits: ``values`` int8 [out, in] and ``scales`` float32
    [out, in / 32] (the file's float16 block scales, exactly), ``values * scales`` per block."""

    values: np.ndarray
    scales: np.ndarray


def convert(
    tensors: Iterator[tuple[str, np.ndarray]],
    weight_map: WeightMap,
    config: ModelConfig,
    dtype: str,
    mesh: Mesh | None = None,
    quantization: str | None = None,
) -> dict:
    """Rename and reshape checkpoint tensors into our parameter tree, checking every shape.
    A layer's (or an expert's) tensor is written into its slice of the stacked parameter on
    device. With ``quantization``, the tree is ``quant.quantized_shapes``' and each linear kernel
    must arrive as ``Q8Blocks`` (its values and block scales are written as they are)."""
    shapes = quant.quantized_shapes(param_shapes(config, dtype), quantization)
    expected = flatten_dict(shapes, sep="/")
    placement = flatten_dict(param_shardings(shapes, mesh), sep="/") if mesh else {}
    patterns = [(re.compile(k), v) for k, v in weight_map.items()]
    flat: dict[str, jax.Array] = {}
    seen: dict[str, set[tuple[int, ...]]] = {}  # stacked parameter -> indices written
    for name, array in tensors:
        targets = match_name(name, patterns)
        if targets is None:
            if _HF_IGNORED.fullmatch(name):
                continue
            raise ValueError(f"unexpected tensor {name!r} in checkpoint for {config.architecture}")
        if not isinstance(array, Q8Blocks):
            array = np.asarray(array, dtype=np.float32)
        for ours, transform in targets:
            if ours == "lm_head/kernel" and config.tie_word_embeddings:
                continue  # tied: the head is the embedding
            parts = [(ours, array)]
            if isinstance(array, Q8Blocks):  # the 8-bit kernel and its scales, one transform
                scale_name = ours.removesuffix("kernel") + quant.SCALE
                parts = [(ours, array.values), (scale_name, array.scales)]
            for part, raw in parts:
                _write(flat, seen, name, part, transform(raw, config), config, expected, placement)
    missing = sorted(set(expected) - set(flat))
    for path, indices in sorted(seen.items()):
        stacked = expected[path].shape[: len(next(iter(indices)))]
        if len(indices) < np.prod(stacked):
            absent = sorted(set(np.ndindex(*stacked)) - indices)
            missing.append(f"{path} (rows {absent[:5]})")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:5]}")
    return unflatten_dict(flat, sep="/")


def _write(flat, seen, name: str, ours: str, value: np.ndarray, config, expected, placement):
    """Checkpoint tensor ``name``'s ``value`` (after its transform) into our parameter ``ours``
    (or its row of a stacked parameter), checked against the expected shape and kind."""
    path, index = _place(ours, config)
    if path not in expected:
        raise ValueError(f"checkpoint tensor {name!r} maps to unknown parameter {ours!r}")
    want = expected[path]
    if (value.dtype == np.int8) != (want.dtype == jnp.int8):
        raise ValueError(
            f"checkpoint tensor {name!r} is {value.dtype}, but {ours!r} is {want.dtype} "
            "(a kernel kept in 8 bits needs every layer's tensor in Q8_0)"
        )
    full = want.shape
    if any(i >= n for i, n in zip(index, full, strict=False)):
        raise ValueError(f"checkpoint tensor {name!r} maps past the end of {path!r}")
    shape = full[len(index) :]
    if value.shape != shape:
        raise ValueError(
            f"tensor {name!r} has shape {value.shape} after conversion, but {ours!r} "
            f"needs {shape}" + (" per layer" if index else "")
        )
    value = value.astype(want.dtype)
    if not index:
        flat[path] = jax.device_put(value, placement.get(path))
        return
    if path not in flat:
        flat[path] = jnp.zeros(full, want.dtype, device=placement.get(path))
    set_rows = _set_rows(placement.get(path), len(index))
    flat[path] = set_rows(flat[path], np.asarray(index, np.int32), value)
    seen.setdefault(path, set()).add(index)


def _place(ours: str, config: ModelConfig) -> tuple[str, tuple[int, ...]]:
    """Our name -> (stacked parameter path, index into its leading axes). A MoE family's layer
    MLP goes to its row of the ``moe`` or ``dense_mlp`` stack."""
    m = _STACKED_NAME.fullmatch(ours)
    if m is None:
        return ours, ()
    layer, rest = int(m[1]), m[2]
    if layer >= config.num_layers:
        return f"layers_{layer}/{rest}", ()  # reported as unknown
    path, row = f"layers/{rest}", layer
    if config.num_experts and rest.startswith("mlp/"):
        stack, row = config.mlp_stack_row(layer)
        path = f"{stack}/{rest[len('mlp/') :]}"
    return path, (row,) if m[3] is None else (row, int(m[3]))


@functools.cache
def _set_rows(sharding, depth: int):
    """stack[index] = value for an index into the first ``depth`` axes, in place (the stack is
    donated); the result keeps ``sharding``."""

    def set_rows(stack, index, value):  # stack: [*stacked, ...]; index: i32[depth]
        value = value.astype(stack.dtype).reshape((1,) * depth + value.shape)
        zero = jnp.zeros((), jnp.int32)
        starts = tuple(index[i] for i in range(depth)) + (zero,) * (stack.ndim - depth)
        return jax.lax.dynamic_update_slice(stack, value, starts)

    if sharding is None:
        return jax.jit(set_rows, donate_argnums=0)
    return jax.jit(set_rows, donate_argnums=0, out_shardings=sharding)


def match_name(name: str, patterns) -> list[tuple[str, Transform]] | None:
    for pattern, targets in patterns:
        m = pattern.fullmatch(name)
        if m:
            return [(template.format(*m.groups()), transform) for template, transform in targets]
    return None
