"""What the GPU kernels of this folder need from Pallas's Triton lowering (jax 0.10 and 0.11;
0.11 deprecates it in favour of Mosaic GPU): compiler params, masked loads and stores, the
shapes its tiles take, and the dots' precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

GPU_LOWERING = "triton"


def dot_precision(dtype) -> jax.lax.Precision | None:
    """The kernels' dots for operands of ``dtype``: float32 at full float32 precision (the
    lowering runs a DEFAULT float32 dot as TF32, about 1e-3 relative), other dtypes as they are."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def compiler_params(*, num_warps: int, num_stages: int):
    """Triton compiler params; the class was ``TritonCompilerParams`` before jax 0.7."""
    cls = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


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
