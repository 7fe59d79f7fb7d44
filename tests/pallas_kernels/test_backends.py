"""The attention backend object: chosen in one place (a name, the setting, the platform), the same
``(q, kv, md, opts)`` operations on every backend, float32 GPU kernels at float32 precision, and
JAX's deprecation of the Triton lowering said once."""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from kernel_cases import decode_case, fresh_rng, numpy_attention, ragged_case, rel_err
from pagedjax.pallas_kernels import (
    AttentionMetadata,
    AttentionOptions,
    NativeBackend,
    PagedKV,
    ReferenceBackend,
    TpuBackend,
    TritonBackend,
    paged_attention,
    ragged_paged_attention,
    select_backend,
)
from pagedjax.pallas_kernels.selection import ENV_SETTING, resolve_name
from pagedjax.pallas_kernels.triton import lowering


def test_auto_is_the_platforms_backend():
    assert type(select_backend("auto", platform="cpu")) is NativeBackend
    assert type(select_backend("auto", platform="gpu")) is TritonBackend
    assert type(select_backend("auto", platform="cuda")) is TritonBackend
    assert type(select_backend("auto", platform="tpu")) is TpuBackend
    assert type(select_backend("gpu")) is TritonBackend  # the GPU's default lowering
    assert type(select_backend("reference")) is ReferenceBackend


def test_the_setting_chooses_when_no_name_is_given(monkeypatch):
    monkeypatch.setenv(ENV_SETTING, "reference")
    assert type(select_backend(None, platform="cpu")) is ReferenceBackend
    assert type(select_backend("native")) is NativeBackend  # an explicit name wins
    monkeypatch.setenv(ENV_SETTING, "TRITON ")
    assert type(select_backend(None)) is TritonBackend
    monkeypatch.delenv(ENV_SETTING)
    assert type(select_backend(None, platform="cpu")) is NativeBackend
    monkeypatch.setenv(ENV_SETTING, "cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend(None)


def test_mosaic_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="Mosaic GPU attention backend is not available"):
        select_backend("mosaic")
    with pytest.raises(ValueError, match="Mosaic GPU"):
        resolve_name("mosaic", platform="gpu")


def test_knobs_go_to_the_backend_that_has_them():
    triton = select_backend("triton", interpret=True, num_warps=8, tile_rows=4)
    assert triton == TritonBackend(interpret=True, num_warps=8)
    assert select_backend("native", interpret=True, tile_rows=4) == NativeBackend(tile_rows=4)
    with pytest.raises(ValueError, match="unknown attention backend knobs"):
        select_backend("triton", num_wraps=8)


def test_a_backend_object_passes_through_and_is_a_static_argument():
    backend = TritonBackend(interpret=True)
    assert select_backend(backend) is backend
    assert hash(backend) == hash(TritonBackend(interpret=True))  # jit's static-argument cache


def _ops_case(request):
    shape = dict(num_heads=8, num_kv_heads=2, block_size=8, head_dim=32, dtype="float32")
    seqs = [(20, 20), (9, 1), (0, 0), (30, 4)]
    case = ragged_case(fresh_rng(request), seqs, pad_rows=3, **shape)
    kv = PagedKV(case.k_pages, case.v_pages)
    md = AttentionMetadata(
        case.block_tables, case.context_lens, case.query_start_loc, max_query_len=20
    )
    return case, kv, md, AttentionOptions(scale=case.scale)


@pytest.mark.parametrize(
    "backend", [ReferenceBackend(), NativeBackend(), TritonBackend(interpret=True)], ids=str
)
def test_every_backend_writes_and_attends_through_the_same_operations(request, backend):
    case, kv, md, opts = _ops_case(request)
    want = numpy_attention(case, window=None, soft_cap=None)
    out = jax.jit(backend.attend)(case.q, kv, md, opts)
    assert rel_err(out, want) <= 2e-5
    # write_kv: rows land at their slots; negative slots are dropped.
    before = np.array(kv.v_pages).reshape(2, -1, 32)
    k_new = jnp.ones((3, 2, 32))
    slots = jnp.array([9, -1, 17], jnp.int32)
    written = backend.write_kv(kv, k_new, 2 * k_new, slots)  # the pool is donated
    flat = np.asarray(written.v_pages).reshape(2, -1, 32)
    assert (flat[:, [9, 17]] == 2).all()
    before[:, [9, 17]] = 2
    assert np.array_equal(flat, before, equal_nan=True)  # nothing else written (-1 dropped)


def _dots(jaxpr) -> list:
    """(precision, operand dtypes) of every dot_general, kernel bodies included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append((eqn.params["precision"], {v.aval.dtype for v in eqn.invars}))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    found += _dots(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    found += _dots(sub)
    return found


@pytest.mark.parametrize("layout", ["decode", "ragged"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernels_ask_for_full_float32_precision(layout, dtype):
    """The Triton lowering runs a DEFAULT-precision float32 dot as TF32 (about 1e-3 relative):
    float32 kernels must ask for HIGHEST; bfloat16 ones stay as they were."""
    q = jnp.zeros((4, 8, 64), dtype)
    pages = jnp.zeros((2, 8, 16, 64), dtype)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    kw = dict(scale=0.1, backend="triton", interpret=True)
    if layout == "decode":
        fn = functools.partial(paged_attention, **kw)
        args = (q[:2], pages, pages, tables, lens)
    else:
        fn = functools.partial(ragged_paged_attention, **kw, max_query_len=3)
        args = (q, pages, pages, tables, lens, jnp.array([0, 3, 4], jnp.int32))
    dots = _dots(jax.make_jaxpr(fn)(*args).jaxpr)
    assert len(dots) == 2, dots  # q @ k.T and p @ v
    want = (jax.lax.Precision.HIGHEST,) * 2 if dtype == "float32" else None
    assert all(precision == want for precision, _ in dots), dots


def test_float32_triton_decode_over_an_8bit_pool_is_full_precision():
    """8-bit pages are cast to the float32 queries' dtype: the dots are float32, at HIGHEST."""
    q = jnp.zeros((2, 8, 64), jnp.float32)
    pages = jnp.zeros((2, 8, 16, 64), jnp.int8)
    scales = jnp.ones((2, 8, 16), jnp.float32)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    fn = functools.partial(paged_attention, scale=0.1, backend="triton", interpret=True)
    jaxpr = jax.make_jaxpr(fn)(q, pages, pages, tables, lens, k_scales=scales, v_scales=scales)
    dots = _dots(jaxpr.jaxpr)
    assert dots and all(p == (jax.lax.Precision.HIGHEST,) * 2 for p, _ in dots), dots


def test_ragged_single_rows_take_the_backends_own_decode(request, monkeypatch):
    """A batch of single rows goes to the backend object's decode, not to a name dispatcher."""
    shape = dict(num_heads=4, num_kv_heads=2, block_size=8, head_dim=32, dtype="float32")
    case = decode_case(fresh_rng(request), [3, 0, 17], **shape)
    kv = PagedKV(case.k_pages, case.v_pages)
    qsl = jnp.array([0, 1, 1, 2], jnp.int32)
    md = AttentionMetadata(case.block_tables, case.context_lens, qsl, max_query_len=1)
    calls = []
    real = ReferenceBackend.decode
    monkeypatch.setattr(
        ReferenceBackend, "decode", lambda self, *a: calls.append(1) or real(self, *a)
    )
    q = jnp.concatenate([case.q[0:1], case.q[2:3], case.q[1:2]])
    out = ReferenceBackend().ragged(q, kv, md, AttentionOptions(scale=case.scale))
    want = numpy_attention(case, window=None, soft_cap=None)
    assert calls == [1]
    assert rel_err(out[:2], np.asarray(want)[[0, 2]]) <= 2e-5
    assert not np.asarray(out[2]).any()  # a row of no sequence


def test_jaxs_triton_deprecation_is_said_once_not_at_every_compile(caplog):
    """jax 0.11 warns a DeprecationWarning at every lowering of a Triton pallas_call (every step
    program a GPU compiles): a kernel lowered for a GPU says it once in the log and that warning,
    only that one, is ignored; interpret mode (no GPU lowering) changes nothing."""
    message = "The Pallas Triton backend is deprecated and will be removed in a future JAX version."
    lowering.note_deprecation.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            lowering.compiler_params(num_warps=4, num_stages=2, interpret=True)
            warnings.warn(message, DeprecationWarning, stacklevel=1)
            assert [str(w.message) for w in seen] == [message]
            seen.clear()
            with caplog.at_level(logging.INFO, logger=lowering.__name__):
                for _ in range(3):
                    lowering.compiler_params(num_warps=4, num_stages=2)
                    warnings.warn(message, DeprecationWarning, stacklevel=1)
            warnings.warn("another deprecation", DeprecationWarning, stacklevel=1)
            warnings.warn(message, UserWarning, stacklevel=1)  # not a deprecation: shown
        assert [str(w.message) for w in seen] == ["another deprecation", message]
        said = [r for r in caplog.records if r.name == lowering.__name__]
        assert len(said) == 1 and "Triton lowering" in said[0].getMessage()
    finally:
        lowering.note_deprecation.cache_clear()  # the filter left with catch_warnings
