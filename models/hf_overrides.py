"""vLLM's ``hf_overrides``: values that replace a checkpoint's config.json entries.

The weights are loaded as the checkpoint has them, so only entries that change no weight's shape
can be overridden: the context length, rope, the norms' epsilon, the sliding window and the
special tokens. Any other key is refused by name (a shape key would not match the weights; an
unknown one would silently do nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import ModelConfig
from .registry import hashable_rope


def _rope_scaling(value) -> dict:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {value!r}")
    return {"rope_scaling": hashable_rope(dict(value or {}))}


def _eos(value) -> dict:
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"eos_token_id must be an integer or a list of them, got {value!r}")
    return {"eos_token_ids": tuple(ids)}


# config.json key -> the ModelConfig fields it sets
_OVERRIDABLE = {
    "max_position_embeddings": lambda v: {"max_position_embeddings": int(v)},
    "rope_theta": lambda v: {"rope_theta": float(v)},
    "rope_scaling": _rope_scaling,
    "rms_norm_eps": lambda v: {"rms_norm_eps": float(v)},
    "sliding_window": lambda v: {"sliding_window": None if v is None else int(v)},
    "bos_token_id": lambda v: {"bos_token_id": None if v is None else int(v)},
    "eos_token_id": _eos,
}
OVERRIDABLE_KEYS = tuple(_OVERRIDABLE)


def apply_hf_overrides(config: ModelConfig, overrides: dict[str, Any] | None) -> ModelConfig:
    """``config`` with ``overrides`` (config.json's names) applied; a key outside
    OVERRIDABLE_KEYS or a bad value raises ValueError naming it."""
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {overrides!r}")
    fields: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in _OVERRIDABLE:
            raise ValueError(
                f"hf_overrides: {key!r} cannot be overridden (the weights are loaded as the "
                f"checkpoint has them); overridable: {', '.join(OVERRIDABLE_KEYS)}"
            )
        try:
            fields |= _OVERRIDABLE[key](value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"hf_overrides: {key}: {e}") from None
    return dataclasses.replace(config, **fields)
