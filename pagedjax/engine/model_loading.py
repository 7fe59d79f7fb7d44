"""Loading the model EngineArgs name, as vLLM's options ask: the compute dtype ("auto" too), the
checkpoint's format, the hub revision and download folder, another tokenizer, and config
overrides. One INFO line per phase, as vLLM logs its start."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from pagedjax import compilation
from pagedjax.models.hf_overrides import apply_hf_overrides
from pagedjax.models.loader import (
    HubOptions,
    LoadedModel,
    default_model_path,
    load_model,
    resolve,
)
from pagedjax.models.sharding import tensor_parallel_mesh
from pagedjax.pallas_kernels import native

logger = logging.getLogger("pagedjax.engine.model_loading")


def resolved_dtype(dtype: str) -> str:
    """The compute dtype: "auto" is float32 on a CPU and bfloat16 on a GPU or TPU (vLLM's auto
    serves a float32 or 16-bit checkpoint in 16 bits; pagedjax's 16-bit type is bfloat16)."""
    if dtype == "float":
        return "float32"
    if dtype != "auto":
        return dtype
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def check_load_format(model: str, load_format: str) -> None:
    """A format that does not match the model is refused before anything loads."""
    gguf = model.endswith(".gguf")
    if load_format == "gguf" and not gguf:
        raise ValueError(f"load_format='gguf' needs a .gguf file, got model={model!r}")
    if load_format == "safetensors" and gguf:
        raise ValueError(f"load_format='safetensors' needs a checkpoint folder, got {model!r}")


def load(args) -> LoadedModel:
    """The model of ``args`` (an EngineArgs), placed on its devices."""
    compilation.enable_persistent_cache()  # before anything compiles, the loader included
    native.prebuild()  # the CPU kernels compile while the model loads (seconds, once)
    model = args.model or default_model_path()
    check_load_format(model, args.load_format)
    for name in ("load_format", "config_format"):  # tokenizer_mode is inert (logged as such)
        if getattr(args, name) == "mistral":
            logger.info("%s='mistral': reading the checkpoint's Hugging Face files", name)
    dtype = resolved_dtype(args.dtype)
    hub = HubOptions(args.revision, args.download_dir, args.hf_token)
    logger.info("Loading %s (dtype=%s, quantization=%s)", model, dtype, args.quantization)
    start = time.perf_counter()
    loaded = load_model(
        model,
        dtype=dtype,
        cache_dir=args.cache_dir,
        mesh=tensor_parallel_mesh(args.tensor_parallel_size),
        quantization=args.quantization,
        hub=hub,
    )
    config = apply_hf_overrides(loaded.config, args.hf_overrides)
    loaded = dataclasses.replace(loaded, config=config)
    if args.tokenizer is not None:
        revision = args.tokenizer_revision or args.revision
        loaded = with_tokenizer(loaded, args.tokenizer, revision, hub)
    mc = loaded.config
    logger.info(
        "Loaded %s in %.1f s: %s, %d layers, context %d tokens",
        Path(loaded.source).name,
        time.perf_counter() - start,
        mc.architecture,
        mc.num_layers,
        mc.max_context_len,
    )
    return loaded


def with_tokenizer(loaded: LoadedModel, tokenizer: str, revision, hub: HubOptions) -> LoadedModel:
    """``loaded`` with the tokenizer of ``tokenizer`` (a folder, a hub id or a .gguf file)."""
    path = resolve(tokenizer, dataclasses.replace(hub, revision=revision))
    if path.is_file():
        return dataclasses.replace(loaded, tokenizer_dir=str(path.parent), gguf_file=path.name)
    return dataclasses.replace(loaded, tokenizer_dir=str(path), gguf_file=None)
