"""Default sampling parameters from the model's generation_config.json, as vLLM applies them
(``--generation-config auto``, its default): a request that leaves temperature, top_p, top_k,
min_p, repetition_penalty or its token limit unset gets the model's value (Qwen's instruct models,
for one, ship temperature 0.7, top_p 0.8, top_k 20). ``"vllm"`` ignores the model's file; a folder
reads that folder's file instead; ``override_generation_config`` sets or replaces values.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger("pagedjax.engine")  # logged as the engine loads

# generation_config.json's name -> SamplingParams' (vLLM's get_diff_sampling_param)
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' GenerationConfig defaults: a file's value equal to one sets nothing (vLLM reads
# the file's to_diff_dict())
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def check_generation_config(source: str, overrides: dict | None) -> None:
    """ValueError naming what is wrong with --generation-config / --override-generation-config
    (checked before a model loads)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f'generation_config must be "auto", "vllm" or a folder, got {source!r}')
    if source not in ("auto", "vllm") and not Path(source).is_dir():
        raise ValueError(f'generation_config: {source!r} is not a folder (or "auto", "vllm")')
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ValueError(f"override_generation_config must be an object, got {overrides!r}")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: {unknown[0]!r} is not one of {', '.join(FIELDS)}"
        )
    _as_params(overrides, "override_generation_config")


def default_sampling_params(source: str, model_dir: str, overrides: dict | None) -> dict:
    """The SamplingParams fields a request gets unless it sets them: those of
    ``generation_config.json`` in ``model_dir`` ("auto") or in the folder ``source``, none
    ("vllm"), then ``overrides`` (generation_config.json's names)."""
    check_generation_config(source, overrides)
    found = {}
    if source != "vllm":
        folder = Path(model_dir if source == "auto" else source)
        found = _read(folder / "generation_config.json")
    found = {
        k: v
        for k, v in found.items()
        if k in FIELDS and v is not None and (k not in _HF_DEFAULTS or v != _HF_DEFAULTS[k])
    }
    for key, value in list(found.items()):  # the model's file: a bad value is left out
        try:
            _as_params({key: value}, "generation_config.json")
        except ValueError as e:
            logger.warning("%s; that value sets no sampling default", e)
            del found[key]
    params = _as_params(found | (overrides or {}), "override_generation_config")
    if params:
        logger.info(
            "default sampling parameters from the model's generation config (a request's own "
            "values win; --generation-config vllm turns this off): %s",
            params,
        )
    return params


def _read(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        logger.warning("%s is unreadable, so it sets no sampling defaults: %s", file, e)
        return {}
    return data if isinstance(data, dict) else {}


def _as_params(values: dict, where: str) -> dict:
    """``values`` (generation_config.json's names) as SamplingParams fields, each checked."""
    params = {FIELDS[k]: v for k, v in values.items()}
    try:
        SamplingParams(**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return params
