"""LoRA adapters as PEFT saves them, loaded on the host for a model's projections.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``): for each targeted module of each layer, ``lora_A`` [r, in] and ``lora_B``
[out, r] (PyTorch's orientation); the module computes ``W x + scaling * B A x`` with scaling
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). ``load_adapter`` turns them into
our projections' ``a`` [num_layers, in, r] and ``b`` [num_layers, r, out] (zeros in the layers an
adapter leaves alone). Phi-3's fused projections (``qkv_proj``, ``gate_up_proj``) are split as
their base weights are at load (models/weight_maps.py): the fused ``A`` serves each part, whose
``B`` is its rows of the fused ``B``. What an adapter needs and we would compute wrongly (DoRA,
biases, extra trained modules, embedding adapters, per-module ranks) is refused with a ValueError
naming it.

The device side (slots, ``set_slot``, the batched matmul) is models/lora_slots.py; its public
names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .lora_slots import (
    ATTENTION_MODULES,
    MLP_MODULES,
    TARGET_MODULES,
    LoRABatch,
    LoRASlots,
    init_slots,
    lora_modules,
    module_dims,
    set_slot,
)

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclasses.dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One adapter on the host, as loaded: per module our ``(a f32[num_layers, in, rank],
    b f32[num_layers, rank, out])``, unscaled (``set_slot`` folds ``scaling`` into b)."""

    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    head_dim: int  # the model's, for slots that replicate KV heads under tensor parallelism

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(self.weights)

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


# PEFT options whose adapters compute something else than ``W x + scaling * B A x`` on the
# projections: refused. (name, the value that is fine)
_UNSUPPORTED = (
    ("use_dora", False),
    ("bias", "none"),
    ("modules_to_save", None),
    ("fan_in_fan_out", False),
    ("lora_bias", False),
    ("trainable_token_indices", None),
    ("layer_replication", None),
    ("target_parameters", None),
    ("alora_invocation_tokens", None),
    ("rank_pattern", None),
    ("alpha_pattern", None),
    ("use_qalora", False),
    ("use_bdlora", False),
    ("arrow_config", None),
    ("kasa_config", None),
    ("monteclora_config", None),
)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def load_adapter(path: str, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter saved by PEFT under ``path``, for a model of ``model_config``; a ValueError
    names the path and what is missing, unreadable, malformed, not finite, too large, or not
    supported. Nothing else escapes: an unexpected failure to read is a ValueError naming its
    cause too."""
    try:
        return _load_adapter(path, model_config, max_rank)
    except ValueError:
        raise
    except Exception as e:  # a reader's own error (OSError, SafetensorError, unpickling, ...)
        raise ValueError(
            f"LoRA adapter {str(path)!r} cannot be read: {type(e).__name__}: {e}"
        ) from e


def _load_adapter(path: str, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    config = _read_config(directory)
    rank, scaling = _rank_and_scaling(config, max_rank, path)
    tensors = _read_tensors(directory)
    pairs = _pairs(tensors, path)
    _check_finite(tensors, scaling, path)
    parts = _module_parts(model_config)
    dims = module_dims(model_config)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (layer, module), (lora_a, lora_b) in sorted(pairs.items()):
        if module not in parts:
            raise ValueError(
                f"LoRA adapter {path!r} targets {module!r}, which {model_config.architecture} "
                f"does not have (or we do not adapt); supported: {sorted(parts)}"
            )
        if layer >= model_config.num_layers:
            raise ValueError(
                f"LoRA adapter {path!r} targets layer {layer}; the model has "
                f"{model_config.num_layers} layers"
            )
        if lora_a.shape[0] != rank or lora_b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {path!r}: {module} of layer {layer} has rank "
                f"{lora_a.shape[0]}, the config's r is {rank}"
            )
        split = parts[module]
        _check_shapes(path, module, layer, lora_a, lora_b, split, dims)
        for ours, (lo, hi) in split:
            a, b = weights.get(ours) or _zero_module(model_config, ours, rank)
            a[layer], b[layer] = lora_a.T, lora_b[lo:hi].T
            weights[ours] = (a, b)
    if not weights:
        raise ValueError(f"LoRA adapter {path!r} has no lora_A/lora_B weights")
    return LoRAAdapter(str(path), rank, scaling, weights, model_config.head_dim)


def _read_config(directory: Path) -> dict:
    file = directory / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {ADAPTER_CONFIG}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"LoRA adapter {str(directory)!r}: cannot read {ADAPTER_CONFIG}: {e}"
        ) from e
    if not isinstance(config, dict):
        raise ValueError(
            f"LoRA adapter {str(directory)!r}: {ADAPTER_CONFIG} must hold a JSON object, got "
            f"{type(config).__name__}"
        )
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {str(directory)!r}: peft_type {peft_type!r} is not LORA")
    for name, fine in _UNSUPPORTED:
        value = config.get(name, fine)
        if value != fine and value not in ({}, [], None, False):
            raise ValueError(f"LoRA adapter {str(directory)!r}: {name}={value!r} is not supported")
    return config


def _rank_and_scaling(config: dict, max_rank: int, path: str) -> tuple[int, float]:
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"LoRA adapter {path!r}: {ADAPTER_CONFIG}'s r={rank!r} is not an integer >= 1"
        )
    if rank > max_rank:
        raise ValueError(f"LoRA adapter rank r={rank} exceeds max_lora_rank={max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(
            f"LoRA adapter {path!r}: {ADAPTER_CONFIG}'s lora_alpha={alpha!r} is not a finite number"
        )
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / root


def _check_finite(tensors: dict[str, np.ndarray], scaling: float, path: str) -> None:
    """Refuse a NaN or inf in any weight, each lora_B as the step uses it: scaled by
    lora_alpha / r in float32 (finite weights can overflow there)."""
    for key in sorted(tensors):
        value = tensors[key]
        scaled = ".lora_B." in key
        if scaled:
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is what we look for
                value = value * np.float32(scaling)
        if not np.isfinite(value).all():
            after = f" after scaling by lora_alpha / r = {scaling:g}" if scaled else ""
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not finite{after}")


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the adapter's weight file, as float32 numpy arrays."""
    safetensors, binary = (directory / f for f in WEIGHT_FILES)
    if safetensors.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(safetensors), framework="flax") as st:
                return {k: np.asarray(st.get_tensor(k), np.float32) for k in st.keys()}  # noqa: SIM118
        except Exception as e:  # SafetensorError (truncated, garbage), OSError, a bad dtype
            raise ValueError(f"{str(safetensors)!r} cannot be read: {type(e).__name__}: {e}") from e
    if binary.is_file():
        try:
            import torch
        except ImportError as e:
            raise ValueError(f"{str(binary)!r} needs torch to read; save as safetensors") from e
        try:
            state = torch.load(str(binary), map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise TypeError(f"it holds a {type(state).__name__}, not a dict of tensors")
            return {str(k): v.float().numpy() for k, v in state.items()}
        except Exception as e:  # unpickling errors, truncation, non-tensor values
            raise ValueError(f"{str(binary)!r} cannot be read: {type(e).__name__}: {e}") from e
    raise ValueError(f"LoRA adapter {str(directory)!r} has neither of {list(WEIGHT_FILES)}")


def _pairs(tensors: dict[str, np.ndarray], path: str) -> dict[tuple[int, str], tuple]:
    """(layer, HF module path within the layer, e.g. "self_attn.q_proj") -> (A, B)."""
    embedding = next((k for k in tensors if ".lora_embedding_" in k), None)
    if embedding is not None:
        raise ValueError(
            f"LoRA adapter {path!r}: embedding adapters are not supported ({embedding!r})"
        )
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: unsupported tensor {key!r}")
        if value.ndim != 2:
            raise ValueError(
                f"LoRA adapter {path!r}: tensor {key!r} has shape {value.shape}; lora_A and "
                "lora_B are matrices"
            )
        layer, module, which = int(match[1]), match[2], match[3]
        found.setdefault((layer, module), {})[which] = value
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} of layer {layer} lacks lora_A/B")
    return {k: (v["A"], v["B"]) for k, v in found.items()}


Split = tuple[tuple[str, tuple[int, int]], ...]  # (our module, rows of the HF B) per part


def _hf_modules(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """HF module path within a layer -> the projections of ours it feeds, in its B's rows."""
    if config.family == "opt":
        names = {f"self_attn.{m}": (m,) for m in ("q_proj", "k_proj", "v_proj")}
        return names | {
            "self_attn.out_proj": ("o_proj",),
            "fc1": ("up_proj",),
            "fc2": ("down_proj",),
        }
    if config.family == "phi3":
        return {
            "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "self_attn.o_proj": ("o_proj",),
            "mlp.gate_up_proj": ("gate_proj", "up_proj"),
            "mlp.down_proj": ("down_proj",),
        }
    attention = {f"self_attn.{m}": (m,) for m in ATTENTION_MODULES}
    return attention | {f"mlp.{m}": (m,) for m in MLP_MODULES}


def _module_parts(config: ModelConfig) -> dict[str, Split]:
    """HF module path within a layer -> our projections it feeds and their rows of its B, for
    the modules an adapter may target in this model."""
    dims, ours = module_dims(config), set(lora_modules(config))
    hf = _hf_modules(config)
    return {k: _fused(dims, names) for k, names in hf.items() if set(names) <= ours}


def _fused(dims: dict[str, tuple[int, int]], names: tuple[str, ...]) -> Split:
    """Consecutive row ranges of a (fused) projection's B, one per part."""
    split, start = [], 0
    for name in names:
        split.append((name, (start, start + dims[name][1])))
        start += dims[name][1]
    return tuple(split)


def _check_shapes(path, module, layer, lora_a, lora_b, split: Split, dims) -> None:
    n_in = dims[split[0][0]][0]
    n_out = split[-1][1][1]
    if lora_a.shape[1] != n_in or lora_b.shape[0] != n_out:
        raise ValueError(
            f"LoRA adapter {path!r}: {module} of layer {layer} has lora_A {lora_a.shape} and "
            f"lora_B {lora_b.shape}; the model's {module} maps {n_in} -> {n_out} "
            "(an adapter for another base model?)"
        )


def _zero_module(config: ModelConfig, module: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    n_in, n_out = module_dims(config)[module]
    layers = config.num_layers
    return np.zeros((layers, n_in, rank), np.float32), np.zeros((layers, rank, n_out), np.float32)


__all__ = [
    "LoRAAdapter",
    "LoRABatch",
    "LoRASlots",
    "TARGET_MODULES",
    "init_slots",
    "load_adapter",
    "set_slot",
]
