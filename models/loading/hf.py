"""A Hugging Face checkpoint directory: config.json and its safetensors files (sharded or not)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..weight_maps import HF_WEIGHT_MAPS


def hf_files(path: Path) -> list[Path]:
    """config.json and the safetensors files of a checkpoint directory (sharded or not)."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(
            f"no config.json in model directory {str(path)!r}; found {sorted(os.listdir(path))}"
        )
    ModelConfig.from_hf_dict(json.loads(config_file.read_text()))  # unsupported: fail first
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no .safetensors weights in {str(path)!r}; found {sorted(os.listdir(path))}"
        )
    return [config_file, *files]


def open_hf_dir(path: Path):
    config_file, *files = hf_files(path)
    config = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))

    def tensors():
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="flax") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, np.asarray(st.get_tensor(name))

    return config, tensors, HF_WEIGHT_MAPS[config.family]
