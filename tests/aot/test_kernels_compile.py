"""Every attention kernel variant compiled for a v5e and a v6e by libtpu's own compiler (Mosaic
and XLA:TPU), and for an H100 by XLA:GPU, Triton and ptxas (``-m slow``, with the CUDA plugin),
no accelerator here. Interpret mode checks the kernels' numbers; only a real compile sees what
the hardware refuses, as it refused every 8-bit kernel while a page's scales were copied into a
slice of one row holding the key block's (the two sides' tiles differed). Kernels that lower but
must fail to compile prove that the compile is real: a lane-unaligned dynamic slice, 256 MiB of
VMEM scratch, a Triton tile over an H100's shared memory (each beside a twin that compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from aot_cases import target_or_skip
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, SingleDeviceSharding

from pagedjax.aot.kernels import compile_kernel, kernel_matrix

CASES = [pytest.param(case, id=case.name.replace(" ", "-")) for case in kernel_matrix()]


def test_the_matrix_covers_what_the_engine_runs():
    cases = kernel_matrix()
    assert len(cases) == len({c.name for c in cases}) == 40
    for layout in ("decode", "ragged"):
        mine = [c for c in cases if c.layout == layout]
        assert {c.kv_dtype for c in mine} == {"float32", "bfloat16", "int8", "fp8"}
        assert {c.group for c in mine} == {1, 4, 8} and {c.head_dim for c in mine} == {64, 128}
        assert {c.block_size for c in mine} == {8, 16, 32}
        assert {c.block_size for c in mine if c.kv_dtype in ("int8", "fp8")} == {16, 32}
        assert any(c.window for c in mine)
    assert any(c.split for c in cases)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("target", ["v5e-1", "v6e-1"])
def test_every_kernel_variant_compiles_for_tpu(target, case):
    compile_kernel(case, target_or_skip(target))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_kernel_variant_compiles_for_h100(case):
    compile_kernel(case, target_or_skip("h100"))


def _compile(target, fn, *shapes):
    device = SingleDeviceSharding(target.devices()[0])
    args = [jax.ShapeDtypeStruct(s, d, sharding=device) for s, d in shapes]
    options = {"xla_gpu_autotune_level": 0} if target.platform == "cuda" else None
    with jax.set_mesh(Mesh(target.devices()[:1], ("tp",))):
        return jax.jit(fn).trace(*args).lower().compile(options)


def _lane_slice(offset_multiple: int):
    """A kernel reading 128 lanes at a dynamic offset, proven a multiple of ``offset_multiple``."""

    def kernel(i_ref, x_ref, o_ref):
        start = pl.multiple_of(i_ref[0] * offset_multiple, offset_multiple)
        o_ref[...] = x_ref[:, pl.ds(start, 128)]

    def fn(x, i):
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec((8, 512), lambda g, i: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda g, i: (0, 0)),
        )
        out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
        return pl.pallas_call(kernel, out_shape=out, grid_spec=spec)(i, x)

    return fn


def test_mosaic_refuses_a_lane_unaligned_dynamic_slice():
    target = target_or_skip("v5e-1")
    shapes = [((8, 512), jnp.float32), ((1,), jnp.int32)]
    _compile(target, _lane_slice(128), *shapes)  # whole vregs of lanes: compiles
    with pytest.raises(Exception, match="Mosaic.*multiple of 128"):
        _compile(target, _lane_slice(1), *shapes)


def _vmem_scratch(mib: int):
    def kernel(x_ref, o_ref, buf):
        buf[0:8, :] = x_ref[...]
        o_ref[...] = buf[0:8, :] * 2

    def fn(x):
        scratch = [pltpu.VMEM((mib * 2**20 // 512, 128), jnp.float32)]
        out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
        return pl.pallas_call(kernel, out_shape=out, scratch_shapes=scratch)(x)

    return fn


@pytest.mark.parametrize("target", ["v5e-1", "v6e-1"])
def test_mosaic_refuses_256_mib_of_vmem_scratch(target):
    target = target_or_skip(target)
    _compile(target, _vmem_scratch(4), ((8, 128), jnp.float32))
    with pytest.raises(Exception, match="exceed memory"):
        _compile(target, _vmem_scratch(256), ((8, 128), jnp.float32))


def _triton_tile(n: int):
    from pagedjax.pallas_kernels.triton.lowering import compiler_params

    def kernel(x_ref, o_ref):
        x = x_ref[...]
        o_ref[...] = jnp.dot(x, x.T, preferred_element_type=jnp.float32)

    def fn(x):
        out = jax.ShapeDtypeStruct((n, n), jnp.float32)
        params = compiler_params(num_warps=4, num_stages=2)
        return pl.pallas_call(kernel, out_shape=out, compiler_params=params)(x)

    return fn


def test_triton_refuses_a_tile_over_the_h100s_shared_memory():
    """A [512, 512] f32 tile (1 MiB) against 227 KiB per block (the sm_90 target's)."""
    target = target_or_skip("h100")
    _compile(target, _triton_tile(64), ((64, 64), jnp.float32))
    with pytest.raises(Exception, match="[Ss]hared memory"):
        _compile(target, _triton_tile(512), ((512, 512), jnp.float32))
