"""A model's config without its weights: what a deviceless compile needs (shapes only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pagedjax.models.config import ModelConfig
from pagedjax.models.loader import default_model_path


def load_model_config(
    model: str | None, revision: str | None = None, token: str | None = None
) -> ModelConfig:
    """The config of ``model``: a ``config.json`` file, a Hugging Face checkpoint directory, a
    .gguf file (its metadata), a hub id (its config.json alone is fetched, at ``revision`` with
    ``token``), or None for the embedded SmolLM2-135M-Instruct GGUF. No weights are read."""
    source = model or default_model_path()
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ValueError(f"no config.json in model directory {source!r}")
    if path.is_file():
        if path.suffix == ".gguf":
            from pagedjax.models.loading.gguf import open_gguf

            return open_gguf(path)[0]
        try:
            return ModelConfig.from_hf_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not a JSON config: {e}") from None
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", source) or source.startswith("."):
        raise ValueError(f"model path does not exist: {source!r}")
    config = _hub_config(source, revision, token)
    return ModelConfig.from_hf_dict(json.loads(Path(config).read_text()))


def _hub_config(repo: str, revision: str | None, token: str | None) -> str:
    try:
        import huggingface_hub

        return huggingface_hub.hf_hub_download(repo, "config.json", revision=revision, token=token)
    except Exception as e:  # offline, unknown or gated repository: one error for the user
        raise ValueError(
            f"model {repo!r} is not a local path and its config.json could not be fetched from "
            f"the Hugging Face hub: {type(e).__name__}: {e}"
        ) from e
