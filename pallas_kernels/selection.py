"""The one place an attention backend is chosen: from a name (or the setting) and the platform.

Names: "auto" (the platform's: Triton on a GPU, the TPU kernels on a TPU, native elsewhere),
"gpu" (the GPU's default lowering, Triton today), "triton", "tpu", "native" (the C++ CPU kernels,
XLA's path where they are not built), "reference" (the pure-jnp oracle) and "mosaic" (the Mosaic
GPU kernels: refused, not part of this version). The engine's setting is the environment
variable ``PAGEDJAX_ATTENTION_BACKEND``; an explicit name passed in wins over it.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from .backend import AttentionBackend
from .cpu import NativeBackend
from .reference import ReferenceBackend
from .tpu import TpuBackend
from .triton import TritonBackend, supports_shapes

BACKENDS = ("auto", "gpu", "triton", "mosaic", "tpu", "native", "reference")
ENV_SETTING = "PAGEDJAX_ATTENTION_BACKEND"
CLASSES = {cls.name: cls for cls in (TritonBackend, TpuBackend, NativeBackend, ReferenceBackend)}
KNOBS = frozenset(f.name for cls in CLASSES.values() for f in dataclasses.fields(cls))


def backend_setting(name: str | None = None) -> str:
    """``name``; where None, the environment's ``PAGEDJAX_ATTENTION_BACKEND``, else "auto"."""
    if name is not None:
        return name
    return os.environ.get(ENV_SETTING, "").strip().lower() or "auto"


def resolve_name(
    name: str,
    *,
    platform: str | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> str:
    """The backend a name stands for on ``platform`` (default: JAX's default backend). "auto" on
    a GPU takes the reference for shapes the Triton kernels cannot tile (given ``block_size`` and
    ``head_dim``); an explicit "triton" keeps them and the kernel raises."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "mosaic":
        raise ValueError(
            "backend='mosaic': the Mosaic GPU attention backend is not available in this "
            "version; use 'triton' (or 'auto') on a GPU"
        )
    if name == "gpu":
        return "triton"
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        shapes_known = block_size is not None and head_dim is not None
        if shapes_known and not supports_shapes(block_size, head_dim):
            return "reference"
        return "triton"
    return "tpu" if platform == "tpu" else "native"


def select_backend(
    name: str | AttentionBackend | None = None,
    *,
    platform: str | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
    **knobs,
) -> AttentionBackend:
    """The backend object for ``name`` (None: the setting, ``backend_setting``); a backend object
    comes back as it is. ``knobs`` are tuning fields (``pages_per_block``, ``interpret``, ...):
    those of the chosen backend are set, the others' ignored; a name no backend has raises."""
    if isinstance(name, AttentionBackend):
        return name
    unknown = sorted(set(knobs) - KNOBS)
    if unknown:
        raise ValueError(f"unknown attention backend knobs {unknown}; known: {sorted(KNOBS)}")
    resolved = resolve_name(
        backend_setting(name), platform=platform, block_size=block_size, head_dim=head_dim
    )
    cls = CLASSES[resolved]
    own = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in knobs.items() if k in own})
