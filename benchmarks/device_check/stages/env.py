"""Stage 1: versions, backend, device, memory, the Pallas lowerings this JAX offers."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import platform
import subprocess
from pathlib import Path

import jax

from ..common import Budget, Context, say


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # absent or broken: say so in the table rather than stop
        return None


def compilation_cache_dir():
    """Where pagedjax keeps compiled programs (None: off); older checkouts had no such cache."""
    try:
        return importlib.import_module("pagedjax.compilation").cache_dir()
    except ImportError:
        return None


# Where pagedjax names the Pallas lowering its GPU kernels take: the Triton backend's folder, or
# (older checkouts) one module of all GPU kernels.
GPU_LOWERING_MODULES = ("pagedjax.pallas_kernels.triton.lowering", "pagedjax.pallas_kernels._gpu")


def gpu_lowering() -> str | None:
    """The lowering pagedjax's GPU kernels take ("triton", ...), None where none says."""
    for name in GPU_LOWERING_MODULES:
        try:
            return getattr(importlib.import_module(name), "GPU_LOWERING", None)
        except ImportError:
            continue
    return None


def run(ctx: Context, budget: Budget, data: dict):
    import jaxlib

    dev = jax.devices()[0]
    data.update(
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        devices=[f"{d.platform}:{d.device_kind}" for d in jax.devices()],
        device_kind=dev.device_kind,
        platform_version=getattr(dev.client, "platform_version", None),
        torch=_version("torch"),
        transformers=_version("transformers"),
        triton=_version("triton"),
        flax=_version("flax"),
        interpret=ctx.interpret,
    )
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats:
        data["memory_bytes_limit"] = stats.get("bytes_limit")
        data["memory_bytes_in_use"] = stats.get("bytes_in_use")
    try:
        import torch

        data["torch_cuda"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            data["torch_cuda_device"] = torch.cuda.get_device_name(0)
            data["torch_cuda_mem_total"] = total
    except Exception as e:  # torch missing or broken: stages 3a/5 will say more
        data["torch_cuda"] = f"{type(e).__name__}: {e}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        data["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=15,
        ).stdout.strip()
    lowerings = {}
    for name in ("triton", "mosaic_gpu", "tpu"):
        try:
            importlib.import_module(f"jax.experimental.pallas.{name}")
            lowerings[name] = "importable"
        except Exception as e:  # a lowering this JAX lacks
            lowerings[name] = f"{type(e).__name__}: {e}"
    data["pallas_lowerings"] = lowerings
    data["jax_pallas_use_mosaic_gpu"] = getattr(jax.config, "jax_pallas_use_mosaic_gpu", None)
    cache = jax.config.jax_compilation_cache_dir or str(compilation_cache_dir())
    entries = len(list(Path(cache).iterdir())) if cache and Path(cache).is_dir() else 0
    data["jax_compilation_cache"] = f"{cache} ({entries} entries at start)"
    data["pagedjax_gpu_lowering"] = gpu_lowering()
    try:
        import jax.experimental.pallas.ops.gpu as jax_gpu_ops

        data["jax_gpu_ops"] = sorted(m.name for m in pkgutil.iter_modules(jax_gpu_ops.__path__))
    except Exception as e:  # no GPU ops in this JAX
        data["jax_gpu_ops"] = f"{type(e).__name__}: {e}"
    for k, v in data.items():
        say(f"  {k}: {v}")
    mem = data.get("memory_bytes_limit")
    summary = (
        f"jax {data['jax']} on {data['backend']}, {data['device_kind']}"
        + (f", JAX limit {mem / 2**30:.1f} GiB" if mem else "")
        + f"; torch {data['torch']} (cuda: {data.get('torch_cuda')}), "
        f"transformers {data['transformers']}"
    )
    return True, summary
