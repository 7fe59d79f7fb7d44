"""The attention kernels' variants, compiled for a target: every dtype of pool (float32,
bfloat16, int8, fp8), GQA ratios 1/4/8, blocks 8/16/32, head_dim 64/128, a sliding window with
a soft cap, and split decode partitions, in the decode and the ragged layout.

Each is the platform backend's ``attend`` over a pool laid out as the engine lays it out there
(pallas_kernels/pool_layout.py), at production-like sizes: the kernels the step programs hold,
compiled one by one so that a failure names its variant.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, SingleDeviceSharding

from pagedjax import pallas_kernels
from pagedjax.models.sharding import AXIS
from pagedjax.pallas_kernels.pool_layout import pool_layout

from .compile import GPU_COMPILER_OPTIONS
from .target_runner import PLATFORMS
from .targets import Target

KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": "fp8"}
NUM_SEQS, MAX_BLOCKS, NUM_BLOCKS = 16, 64, 1024
NUM_TOKENS, MAX_QUERY = 256, 128  # a ragged batch: packed rows, the longest query


@dataclasses.dataclass(frozen=True)
class KernelCase:
    layout: str  # "decode" (one query row per sequence) or "ragged" (packed rows)
    kv_dtype: str  # a key of KV_DTYPES; queries are bfloat16 unless the pool is float32
    group: int  # query heads per KV head
    block_size: int
    head_dim: int
    window: bool = False  # a sliding window (traced) and a soft cap
    split: bool = False  # decode contexts split into partitions

    @property
    def name(self) -> str:
        extra = " window+cap" * self.window + " split" * self.split
        return (
            f"{self.layout} {self.kv_dtype} g{self.group} bs{self.block_size} "
            f"d{self.head_dim}{extra}"
        )


def kernel_matrix() -> list[KernelCase]:
    """The variants: per layout, bfloat16 over GQA 1/4/8 x blocks 8/16/32 (head_dim 128), head
    dim 64, float32, a window with a cap, 8-bit pools (int8, fp8) at blocks 16 and 32 and
    head_dim 64; for decode also split partitions (bfloat16 and int8)."""
    cases = []
    for layout in ("decode", "ragged"):
        case = functools.partial(KernelCase, layout)
        cases += [case("bfloat16", g, bs, 128) for g in (1, 4, 8) for bs in (8, 16, 32)]
        cases += [case("bfloat16", 4, 16, 64), case("float32", 4, 16, 128)]
        cases += [case("float32", 1, 32, 64), case("bfloat16", 4, 16, 128, window=True)]
        cases += [case(dt, 4, bs, 128) for dt in ("int8", "fp8") for bs in (16, 32)]
        cases += [case("int8", 4, 16, 64), case("int8", 4, 16, 128, window=True)]
    cases += [KernelCase("decode", dt, 4, 16, 128, split=True) for dt in ("bfloat16", "int8")]
    return cases


def _pool_dtype(name: str):
    return jnp.float8_e4m3fn if name == "fp8" else jnp.dtype(KV_DTYPES[name])


def compile_kernel(case: KernelCase, target: Target):
    """``case``'s attention compiled for ``target`` (the compiler's exception if it refuses)."""
    options = GPU_COMPILER_OPTIONS if target.platform == "cuda" else None
    with jax.set_mesh(Mesh(target.devices()[:1], (AXIS,))):  # Pallas reads the chip off it
        return _lower(case, target).compile(options)


def _lower(case: KernelCase, target: Target):
    platform = PLATFORMS[target.platform]
    device = SingleDeviceSharding(target.devices()[0])
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)  # noqa: E731
    num_kv_heads = 2
    dtype = _pool_dtype(case.kv_dtype)
    q_dtype = jnp.float32 if case.kv_dtype == "float32" else jnp.bfloat16
    layout = pool_layout(platform, case.block_size, case.head_dim)
    pages = sds((num_kv_heads, NUM_BLOCKS, case.block_size, layout.head_dim), dtype)
    pool = [pages, pages]
    if case.kv_dtype in ("int8", "fp8"):
        pool += [sds((num_kv_heads, NUM_BLOCKS, layout.scale_width), jnp.float32)] * 2
    rows = NUM_SEQS if case.layout == "decode" else NUM_TOKENS
    q = sds((rows, num_kv_heads * case.group, case.head_dim), q_dtype)
    tables = sds((NUM_SEQS, MAX_BLOCKS), jnp.int32)
    lens = sds((NUM_SEQS,), jnp.int32)
    qsl = sds((NUM_SEQS + 1,), jnp.int32) if case.layout == "ragged" else None
    knobs = {"partition_size": 4 * case.block_size * 8} if case.split else {}
    backend = pallas_kernels.select_backend(
        platform=platform, block_size=case.block_size, head_dim=case.head_dim, **knobs
    )
    max_query = MAX_QUERY if case.layout == "ragged" else None

    def attend(q, pool, tables, lens, qsl, window):
        md = pallas_kernels.AttentionMetadata(tables, lens, qsl, max_query_len=max_query)
        opts = pallas_kernels.AttentionOptions(0.1, window, 30.0 if case.window else None)
        return backend.attend(q, pallas_kernels.PagedKV(*pool), md, opts)

    window = sds((), jnp.int32) if case.window else None
    return jax.jit(attend).trace(q, tuple(pool), tables, lens, qsl, window).lower()
