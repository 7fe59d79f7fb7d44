"""The native backend's chunked decode attention (its XLA path) against the float64 numpy oracle.

Pools start all-NaN (stale slots), block tables end in padding, and lengths fall on and off block
and chunk boundaries, with windows (traced and static) that start mid-chunk and soft caps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import HEADS, decode_case, fresh_rng, numpy_attention, rel_err
from pagedjax.pallas_kernels import native, paged_attention
from pagedjax.pallas_kernels.attention import flat_entry
from pagedjax.pallas_kernels.cpu.chunked import SINGLE_PASS_TOKENS, chunked_decode
from test_sliding_window_soft_cap import poison_before_windows

LENS = [0, 1, 7, 8, 9, 16, 23, 40, 57, 64]
paged_attention_chunked = flat_entry(
    chunked_decode, name="paged_attention_chunked", ragged=False, doc="chunked_decode, flat"
)


def run(case, *, chunk_tokens, window=None, soft_cap=None):
    fn = functools.partial(
        paged_attention_chunked, scale=case.scale, soft_cap=soft_cap, chunk_tokens=chunk_tokens
    )
    return jax.jit(lambda args, w: fn(*args, sliding_window=w))(case.args(), window)


def check(case, out, *, window=None, soft_cap=None, tol=2e-5):
    err = rel_err(out, numpy_attention(case, window=window, soft_cap=soft_cap))
    assert err <= tol, f"window={window} soft_cap={soft_cap}: rel err {err:.2e}"
    idle = [s for s, n in enumerate(np.asarray(case.context_lens)) if n == 0]
    assert not np.asarray(out, np.float32)[idle].any(), "an empty sequence gives zeros"


@pytest.mark.parametrize("block_size,ratio", [(8, 4), (16, 1), (32, 8), (16, 5)])
@pytest.mark.parametrize("chunk_tokens", [16, 64])
def test_matches_oracle_across_chunks(request, block_size, ratio, chunk_tokens):
    num_heads, num_kv_heads = HEADS[ratio]
    case = decode_case(
        fresh_rng(request),
        LENS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=64,
        dtype=jnp.float32,
    )
    check(case, run(case, chunk_tokens=chunk_tokens))


@pytest.mark.parametrize("window", [5, 19, 1000, 0])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_window_and_cap(request, window, soft_cap):
    shape = dict(num_heads=4, num_kv_heads=2, block_size=8, head_dim=32, dtype=jnp.float32)
    case = decode_case(fresh_rng(request), LENS, **shape)
    case = poison_before_windows(case, window)  # slots before each window: NaN, null block
    out = run(case, chunk_tokens=16, window=jnp.int32(window), soft_cap=soft_cap)
    check(case, out, window=window, soft_cap=soft_cap)


def test_bfloat16(request):
    shape = dict(num_heads=8, num_kv_heads=2, block_size=16, head_dim=64, dtype=jnp.bfloat16)
    case = decode_case(fresh_rng(request), LENS, **shape)
    out = run(case, chunk_tokens=32)
    assert out.dtype == jnp.bfloat16
    check(case, out, tol=1.5e-2)


def test_engine_decode_on_cpu_takes_the_chunked_path_for_long_tables(request, monkeypatch):
    """The public entry point on the native backend, where no native kernel serves (switched
    off here; on a CPU where it builds, this XLA path is what other platforms lower): one pass
    over a table of at most SINGLE_PASS_TOKENS, the chunked loop over a longer one; the
    oracle's numbers either way."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    paged_attention.clear_cache()  # traced under the switch, and again after the test
    request.addfinalizer(paged_attention.clear_cache)
    shape = dict(num_heads=4, num_kv_heads=2, block_size=8, head_dim=32, dtype=jnp.float32)
    case = decode_case(fresh_rng(request), LENS, **shape)
    fn = functools.partial(paged_attention, scale=case.scale, backend="native")
    for extra, loop in ((0, False), (SINGLE_PASS_TOKENS // 8, True)):
        # padding columns: the null block (NaN), past every context
        table = jnp.pad(case.block_tables, ((0, 0), (0, extra)))
        padded = dataclasses.replace(case, block_tables=table)
        check(padded, fn(*padded.args()))
        assert ("while[" in str(jax.make_jaxpr(fn)(*padded.args()))) == loop


def _int8(pages):
    """An int8 pool and its per-token scales for float ``pages``; stale (NaN) slots get NaN
    scales (int8 cannot hold NaN), so a leak shows."""
    x = np.asarray(pages, np.float32)
    scale = np.abs(x).max(-1) / 127  # [kv_heads, num_blocks, block_size]; NaN where stale
    q = np.where(np.isfinite(x), np.round(x / np.where(scale > 0, scale, 1)[..., None]), 0)
    return jnp.asarray(q, jnp.int8), jnp.asarray(scale, jnp.float32)


def test_int8_pool_matches_the_dequantized_oracle(request):
    shape = dict(num_heads=8, num_kv_heads=2, block_size=8, head_dim=32, dtype=jnp.float32)
    case = decode_case(fresh_rng(request), LENS, **shape)
    (k, ks), (v, vs) = _int8(case.k_pages), _int8(case.v_pages)
    deq = dataclasses.replace(
        case,
        k_pages=k.astype(jnp.float32) * ks[..., None],
        v_pages=v.astype(jnp.float32) * vs[..., None],
    )
    out = jax.jit(functools.partial(paged_attention_chunked, scale=case.scale, chunk_tokens=16))(
        case.q, k, v, case.block_tables, case.context_lens, k_scales=ks, v_scales=vs
    )
    check(deq, out)
