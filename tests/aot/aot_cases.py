"""What the deviceless-compile tests share: their targets (each test needs its target's compiler,
libtpu: jax's [tpu] extra, which .ci/run installs; the CUDA 12 plugin: [cuda], which `make
test-all` installs, and skips, saying which, where it is absent) and the models of configs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagedjax.models.config import ModelConfig

from pagedjax.aot.targets import get_target

CONFIGS = Path(__file__).parent / "configs"


def target_or_skip(name: str):
    """The target ``name``, or a skip naming the package its compiler comes in."""
    target = get_target(name)
    if not target.available():
        extra = "tpu" if target.platform == "tpu" else "cuda"
        pytest.skip(f"{name} needs {target.plugin}: pip install 'pagedjax[{extra}]' (not here)")
    return target


def model_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """A model of tests/aot/configs/ (a Hugging Face config.json), its layers cut if asked."""
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    if num_layers is not None:
        d["num_hidden_layers"] = num_layers
    return ModelConfig.from_hf_dict(d)
