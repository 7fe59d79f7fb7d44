"""What the GPU kernels of this folder need from Pallas's Triton lowering (jax 0.10 and 0.11;
0.11 deprecates it in favour of Mosaic GPU): compiler params, masked loads and stores, the
shapes its tiles take, and the dots' precision.
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

GPU_LOWERING = "triton"
# What jax 0.11 warns at every lowering of a Triton pallas_call: each step program a GPU compiles.
DEPRECATION = r"The Pallas Triton backend is deprecated"

logger = logging.getLogger(__name__)


def dot_precision(dtype) -> jax.lax.Precision | None:
    """The kernels' dots for operands of ``dtype``: float32 at full float32 precision (the
    lowering runs a DEFAULT float32 dot as TF32, about 1e-3 relative), other dtypes as they are."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def compiler_params(*, num_warps: int, num_stages: int, interpret: bool = False):
    """Triton compiler params; the class was ``TritonCompilerParams`` before jax 0.7. A kernel
    that will be lowered for a GPU (not ``interpret``) says once that it uses the deprecated
    lowering (``note_deprecation``)."""
    if not interpret:
        note_deprecation()
    cls = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


@functools.cache
def note_deprecation() -> None:
    """Say once, in the log, that these kernels use the Triton lowering JAX deprecates (their
    Mosaic GPU forms are not in this version), and ignore JAX's warning of it (that message
    only, as a DeprecationWarning) for the process: JAX warns when jit lowers a whole step
    program, after the kernel's call has returned, so a filter around the call cannot see it."""
    warnings.filterwarnings("ignore", message=DEPRECATION, category=DeprecationWarning)
    logger.info(
        "the GPU attention kernels use Pallas's Triton lowering, which JAX deprecates in favour "
        "of Mosaic GPU; said once here instead of JAX's warning at every compile"
    )


def masked_store(ref, value, mask):
    """Store ``value`` where ``mask`` (same shape) holds; other elements of ``ref`` untouched."""
    plgpu.store(ref, value, mask=mask)


def masked_load(ref, mask, other=0):
    return plgpu.load(ref, mask=mask, other=other)


def check_gpu_shapes(*, block_size: int, head_dim: int, block_k: int) -> None:
    """Triton tiles must be powers of two and matmul dims at least 16."""
    for name, value in (("block_size", block_size), ("head_dim", head_dim)):
        if value & (value - 1):
            raise ValueError(
                f"the GPU kernel needs a power-of-two {name}, got {value}; use "
                "backend='reference' or 'native'"
            )
    if head_dim < 16:
        raise ValueError(f"the GPU kernel needs head_dim >= 16, got {head_dim}")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(
            f"pages_per_block * block_size = {block_k} must be a power of two >= 16 on GPU"
        )
