"""The native backend's CPU kernel (pallas_kernels/cpu/native.py) against the oracles.

Every case runs on the same arrays as the pure-jnp references and the float64 numpy oracle of
``kernel_cases``: pools NaN everywhere but the live slots, random block tables with a padding
column, lengths on and off block boundaries and 0, GQA ratios 1/4/8, block sizes 8/16/32, head
dims 64/128 and others (72, 80), float32 and bfloat16, 8-bit pools, windows static and traced,
soft caps. Then the transforms the engine puts it under (scan with the pool as carry, shard_map,
vmap), and the dispatch: the CPU custom call in CPU programs only, XLA's path when switched off
or when the build fails.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from kernel_cases import TOLERANCE, decode_case, fresh_rng, numpy_attention, ragged_case, rel_err
from pagedjax.pallas_kernels import (
    AttentionMetadata,
    AttentionOptions,
    NativeBackend,
    PagedKV,
    native,
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pagedjax.pallas_kernels.cpu import native as native_attention
from test_kv8 import poison_before_window, quantize_case

pytestmark = pytest.mark.skipif(
    not native_attention.available(), reason="native kernel unavailable (no compiler?)"
)

# (block_size, head_dim, gqa ratio -> (num_heads, num_kv_heads), q dtype, pool dtype)
DECODE_SHAPES = [
    (8, 64, (8, 2), "float32", "float32"),
    (16, 128, (16, 2), "bfloat16", "bfloat16"),
    (32, 64, (2, 2), "bfloat16", "bfloat16"),
    (16, 80, (8, 2), "float32", "float32"),
    (8, 72, (16, 2), "float32", "bfloat16"),  # 72: a head dim with a scalar tail
    (32, 128, (4, 4), "float32", "float32"),
]
RAGGED_SEQS = [  # (context_len, query_len): prefill, decodes, empty, chunked prefills
    (40, 40),
    (17, 1),
    (0, 0),
    (33, 5),
    (64, 20),
    (5, 1),
    (1, 1),
    (50, 17),
]
WINDOW, SOFT_CAP = 11, 2.5

native_decode = functools.partial(paged_attention, backend="native")
native_ragged = functools.partial(ragged_paged_attention, backend="native")


def decode_lens(block_size: int) -> list[int]:
    b = block_size
    return [0, 1, b - 1, b, b + 1, 2 * b + 3, 5 * b, 3 * b - 2]


def check(out, want, dtype: str, what: str) -> None:
    err = rel_err(out, want)
    assert err <= TOLERANCE[dtype], f"{what}: rel err {err:.2e} > {TOLERANCE[dtype]}"


def shape_id(shape) -> str:
    bs, d, (h, kh), qd, pd = shape
    return f"bs{bs}-d{d}-gqa{h // kh}-q{qd}-pages{pd}"


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=shape_id)
def test_decode_matches_oracles(request, shape):
    block_size, head_dim, (num_heads, num_kv_heads), q_dtype, pool_dtype = shape
    case = decode_case(
        fresh_rng(request),
        decode_lens(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=pool_dtype,
    )
    case.q = case.q.astype(q_dtype)
    tol = "bfloat16" if "bfloat16" in (q_dtype, pool_dtype) else "float32"
    out = native_decode(*case.args(), scale=case.scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    ref = paged_attention_reference(*case.args(), scale=case.scale)
    check(out, ref, tol, "vs paged_attention_reference")
    check(out, numpy_attention(case, window=None, soft_cap=None), tol, "vs float64 oracle")
    assert not np.asarray(out[0], np.float32).any(), "length 0 must give zeros"

    # A static window with a soft cap; then traced windows (one program for every value).
    out = native_decode(*case.args(), scale=case.scale, sliding_window=WINDOW, soft_cap=SOFT_CAP)
    check(out, numpy_attention(case, window=WINDOW, soft_cap=SOFT_CAP), tol, "window + cap")
    for window in (block_size + 3, 1, 0):
        w = jnp.int32(window)
        out = native_decode(*case.args(), scale=case.scale, sliding_window=w)
        want = numpy_attention(case, window=window, soft_cap=None)
        check(out, want, tol, f"traced window {window}")


def test_threads_split_the_same_work():
    """Tasks are independent: one thread and all of them give the same bits."""
    rng = np.random.default_rng(0)
    case = decode_case(
        rng, rng.integers(0, 90, 24), num_heads=8, num_kv_heads=2, block_size=16, head_dim=64,
        dtype="float32",
    )  # fmt: skip
    one = native_decode(*case.args(), scale=case.scale, num_threads=1)
    every = native_decode(*case.args(), scale=case.scale)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(every))


def _ragged(request, *, block_size=16, head_dim=64, heads=(8, 2), dtype="float32", seqs=None):
    return ragged_case(
        fresh_rng(request),
        RAGGED_SEQS if seqs is None else seqs,
        pad_rows=5,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        block_size=block_size,
        head_dim=head_dim,
        dtype=dtype,
    )


@pytest.mark.parametrize(
    "block_size,head_dim,heads,dtype",
    [
        (16, 64, (8, 2), "float32"),
        (8, 128, (16, 2), "bfloat16"),
        (32, 80, (2, 2), "float32"),
        (32, 64, (2, 2), "float32"),  # two 16-key chunks per page, one head per KV head
    ],
    ids=["bs16-d64-gqa4-f32", "bs8-d128-gqa8-bf16", "bs32-d80-gqa1-f32", "bs32-d64-gqa1-f32"],
)
def test_ragged_matches_oracles(request, block_size, head_dim, heads, dtype):
    case = _ragged(request, block_size=block_size, head_dim=head_dim, heads=heads, dtype=dtype)
    kw = dict(scale=case.scale, max_query_len=case.max_query_len)
    out = native_ragged(*case.args(), **kw)
    check(out, ragged_paged_attention_reference(*case.args(), **kw), dtype, "vs jnp reference")
    check(out, numpy_attention(case, window=None, soft_cap=None), dtype, "vs float64 oracle")
    pad = np.asarray(out[int(case.query_start_loc[-1]) :], np.float32)
    assert pad.size and not pad.any(), "padding rows (NaN queries) must come back zero"

    out = native_ragged(*case.args(), **kw, sliding_window=jnp.int32(WINDOW), soft_cap=SOFT_CAP)
    check(out, numpy_attention(case, window=WINDOW, soft_cap=SOFT_CAP), dtype, "window + cap")
    # Tiles smaller than a sequence's rows and than a block: the same answer.
    out = native_ragged(*case.args(), **kw, sliding_window=WINDOW, tile_rows=3)
    check(out, numpy_attention(case, window=WINDOW, soft_cap=None), dtype, "tile_rows=3")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_row_gets_the_same_bits_in_a_decode_or_any_tile(request, head_dim):
    """At head dims 64 and 128 a row's arithmetic does not depend on what else the call holds:
    a prefill tile of 16 rows, of 3, of 1, and the decode kernel give the same bits, so a token
    computed in a mixed step, a chunk of any size or a decode step (preemption by recompute,
    chunked prefill) is the same token."""
    case = _ragged(request, head_dim=head_dim, heads=(12, 4), seqs=[(40, 40), (37, 17), (9, 9)])
    kw = dict(scale=case.scale, max_query_len=case.max_query_len, sliding_window=jnp.int32(29))
    tiles = [np.asarray(native_ragged(*case.args(), **kw, tile_rows=t)) for t in (16, 3, 1)]
    for other in tiles[1:]:
        np.testing.assert_array_equal(tiles[0], other)
    # Each sequence's rows, one decode call per position (context cut at the row's own key).
    qsl = np.asarray(case.query_start_loc)
    for i, ctx in enumerate(np.asarray(case.context_lens)):
        rows = range(int(qsl[i]), int(qsl[i + 1]))
        first_pos = int(ctx) - len(rows)
        for j, row in enumerate(rows):
            lens = np.zeros_like(np.asarray(case.context_lens))
            lens[i] = first_pos + j + 1
            q = jnp.zeros((len(lens), *case.q.shape[1:]), case.q.dtype).at[i].set(case.q[row])
            out = native_decode(
                q, case.k_pages, case.v_pages, case.block_tables, jnp.asarray(lens),
                scale=case.scale, sliding_window=jnp.int32(29),
            )  # fmt: skip
            np.testing.assert_array_equal(np.asarray(out[i]), tiles[0][row])


def test_ragged_rows_past_max_query_len_are_zero(request):
    """As the reference: a sequence's rows at or past max_query_len come back zero."""
    case = _ragged(request)
    kw = dict(scale=case.scale, max_query_len=8)
    out = native_ragged(*case.args(), **kw)
    ref = ragged_paged_attention_reference(*case.args(), **kw)
    check(out, ref, "float32", "max_query_len=8")
    assert not np.asarray(out[8:40]).any(), "the 40-row prefill's rows 8.. must be zero"


def test_ragged_pure_decode(request):
    """max_query_len 1: one row (or none) per sequence, through the decode kernel."""
    case = _ragged(request, seqs=[(30, 1), (0, 0), (17, 1), (1, 1), (16, 1), (5, 0)])
    kw = dict(scale=case.scale, max_query_len=1, sliding_window=jnp.int32(7))
    out = native_ragged(*case.args(), **kw)
    check(out, ragged_paged_attention_reference(*case.args(), **kw), "float32", "decode rows")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_kv8_pools(request, layout, kv_dtype):
    """8-bit pages with NaN scales (and NaN fp8 pages) in stale slots and before the window."""
    rng = fresh_rng(request)
    dtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_dtype]
    shape = dict(num_heads=8, num_kv_heads=2, block_size=8, head_dim=64, dtype=jnp.float32)
    if layout == "decode":
        case = decode_case(rng, decode_lens(8), **shape)
    else:
        case = ragged_case(rng, RAGGED_SEQS, pad_rows=3, **shape)
    c = poison_before_window(quantize_case(rng, case, dtype), WINDOW)
    kw = dict(scale=c.case.scale, sliding_window=WINDOW, soft_cap=SOFT_CAP, **c.scales())
    if layout == "decode":
        out = native_decode(*c.args(), **kw)
    else:
        out = native_ragged(*c.args(), **kw, max_query_len=c.case.max_query_len)
    want = numpy_attention(c.case, window=WINDOW, soft_cap=SOFT_CAP)
    check(out, want, "float32", f"{layout} {kv_dtype}")


def test_under_scan_with_the_pool_as_carry(request):
    """The engine's layout: layers stacked along the pool's blocks, tables offset per layer, the
    window traced per layer, the pool the scan's carry."""
    layers = 3
    case = decode_case(
        fresh_rng(request), decode_lens(16), num_heads=8, num_kv_heads=2, block_size=16,
        head_dim=64, dtype="float32",
    )  # fmt: skip
    num_blocks = case.k_pages.shape[1]
    stack = lambda x: jnp.concatenate([x * (i + 1) for i in range(layers)], axis=1)
    pool = (stack(case.k_pages), stack(case.v_pages))
    windows = jnp.array([0, WINDOW, 5], jnp.int32)

    def layer(pool, xs):
        i, window = xs
        tables = case.block_tables + i * num_blocks
        out = paged_attention(
            case.q, *pool, tables, case.context_lens, scale=case.scale, sliding_window=window
        )
        return pool, out

    _, outs = jax.jit(lambda pool: jax.lax.scan(layer, pool, (jnp.arange(layers), windows)))(pool)
    for i in range(layers):
        k, v = case.k_pages * (i + 1), case.v_pages * (i + 1)
        want = paged_attention_reference(
            case.q, k, v, case.block_tables, case.context_lens, scale=case.scale,
            sliding_window=windows[i],
        )  # fmt: skip
        check(outs[i], want, "float32", f"layer {i}")


def test_under_shard_map_and_vmap(request):
    case = _ragged(request)
    kw = dict(scale=case.scale, max_query_len=case.max_query_len)
    want = ragged_paged_attention_reference(*case.args(), **kw)
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    heads, rep = P(None, "tp", None), P()
    pool = P("tp", None, None, None)
    sharded = jax.shard_map(
        functools.partial(ragged_paged_attention, **kw),
        mesh=mesh,
        in_specs=(heads, pool, pool, rep, rep, rep),
        out_specs=heads,
        check_vma=False,
    )
    check(jax.jit(sharded)(*case.args()), want, "float32", "shard_map")

    qs = jnp.stack([case.q, -2 * case.q])  # two query sets over the same pool
    batched = jax.vmap(lambda q: native_ragged(q, *case.args()[1:], **kw))(qs)
    check(batched[0], want, "float32", "vmap [0]")
    other = ragged_paged_attention_reference(qs[1], *case.args()[1:], **kw)
    check(batched[1], other, "float32", "vmap [1]")


def test_validation_names_bad_values():
    case = decode_case(
        np.random.default_rng(1), [3, 9], num_heads=4, num_kv_heads=2, block_size=8, head_dim=64,
        dtype="float32",
    )  # fmt: skip
    kv = PagedKV(case.k_pages, case.v_pages)
    md = AttentionMetadata(case.block_tables, case.context_lens)
    with pytest.raises(ValueError, match="float16"):
        native_attention.native_decode(
            case.q.astype(jnp.float16), kv, md, AttentionOptions(scale=0.1)
        )
    with pytest.raises(ValueError, match="num_threads"):
        native_decode(*case.args(), scale=0.1, num_threads=0)
    with pytest.raises(ValueError, match="k_scales"):
        native_decode(
            case.q, case.k_pages.astype(jnp.int8), case.v_pages.astype(jnp.int8),
            *case.args()[3:], scale=0.1,
        )  # fmt: skip
    qsl = jnp.array([0, 1, 2], jnp.int32)
    with pytest.raises(ValueError, match="tile_rows"):
        NativeBackend(tile_rows=0)
    with pytest.raises(ValueError, match="query_start_loc"):
        native_ragged(*case.args(), qsl[:2], scale=0.1)


# --- dispatch -----------------------------------------------------------------------------------


def _shapes():
    f32, i32 = jnp.float32, jnp.int32
    s = jax.ShapeDtypeStruct
    pool = s((2, 64, 16, 64), f32)
    return s((4, 8, 64), f32), pool, pool, s((4, 4), i32), s((4,), i32), s((5,), i32)


def _decode_hlo(backend="native", **lower) -> str:
    q, k, v, tables, lens, _ = _shapes()
    fn = jax.jit(functools.partial(paged_attention, scale=0.1, backend=backend))
    return fn.trace(q, k, v, tables, lens).lower(**lower).as_text()


def _ragged_hlo(backend="auto") -> str:
    fn = jax.jit(
        functools.partial(ragged_paged_attention, scale=0.1, max_query_len=4, backend=backend)
    )
    return fn.lower(*_shapes()).as_text()


def _native_calls(hlo: str) -> int:
    return len(re.findall(r"custom_call @pagedjax_PagedAttention", hlo))


@pytest.fixture
def fresh_traces():
    """The public entry points are jitted: retrace them under the test's settings, and after."""
    for fn in (paged_attention, ragged_paged_attention):
        fn.clear_cache()
    yield
    for fn in (paged_attention, ragged_paged_attention):
        fn.clear_cache()


def test_cpu_programs_call_the_native_kernel(fresh_traces):
    assert _native_calls(_decode_hlo()) == 1
    assert _native_calls(_ragged_hlo()) == 1
    # Lowered for a GPU with backend="native": XLA's gathers, no CPU custom call.
    gpu = _decode_hlo(lowering_platforms=("cuda",))
    assert _native_calls(gpu) == 0 and "gather" in gpu


def test_the_reference_backend_never_calls_the_native_kernel(fresh_traces):
    assert _native_calls(_decode_hlo("reference")) == 0
    assert _native_calls(_ragged_hlo("reference")) == 0


def _xla_path_matches(request) -> None:
    assert not native_attention.available()
    assert _native_calls(_decode_hlo()) == 0 and _native_calls(_ragged_hlo()) == 0
    case = _ragged(request)
    kw = dict(scale=case.scale, max_query_len=case.max_query_len)
    out = ragged_paged_attention(*case.args(), **kw)
    check(out, numpy_attention(case, window=None, soft_cap=None), "float32", "XLA path")


def test_switched_off_takes_xla_path(request, monkeypatch, fresh_traces):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    _xla_path_matches(request)


def test_build_failure_warns_and_falls_back(request, monkeypatch, tmp_path, fresh_traces):
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})  # forget this process's build
    with pytest.warns(RuntimeWarning, match="unavailable, using XLA's path"):
        assert not native_attention.available()
    assert not list((tmp_path / "native").glob("*.so")), "no library may be left behind"
    _xla_path_matches(request)
