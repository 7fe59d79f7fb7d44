"""8-bit KV pools (int8, float8_e4m3fn) with per-token, per-KV-head f32 scales.

``write_kv`` quantizes each new row per KV head (symmetric: int8 ``round(x / s)``, s = max|x| / 127;
fp8 ``x / s``, s = max|x| / 448) and writes its scale at the same slot; every attention path reads
``pages * scales[..., None]``. The attention tests fill 8-bit pools through ``write_kv`` from the
float cases of ``kernel_cases`` and compare against the float64 numpy oracle run on the
*dequantized* pool, so the only expected error is float32 rounding. Stale slots (never written,
or before a sliding window) hold NaN scales, and NaN pages where the dtype has NaN (fp8); int8
stale pages hold random bytes. None of it may leak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    PAGES_PER_BLOCK,
    TOLERANCE,
    decode_case,
    device_lowering_case,
    first_key,
    fresh_rng,
    numpy_attention,
    on_backend,
    query_positions,
    ragged_case,
    rel_err,
)
from pagedjax.pallas_kernels import (
    copy_blocks,
    gather_blocks,
    paged_attention,
    paged_attention_reference,
    quantize_kv,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    scatter_blocks,
    write_kv,
    write_kv_reference,
)

KV8 = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
SHAPE = dict(num_heads=4, num_kv_heads=2, block_size=8, head_dim=32, dtype=jnp.float32)
DECODE_LENS = [0, 1, 8, 9, 23, 40]  # empty, one token, on and off block boundaries
RAGGED_SEQS = [(21, 13), (40, 6), (0, 0), (1, 1), (9, 9), (30, 1)]  # (context_len, query_len)
WINDOW = 11  # spans two blocks, shorter than most contexts
SOFT_CAP = 2.0
TOL = 2e-5  # max |out - ref| / max |ref| against the dequantized float64 oracle


@dataclasses.dataclass
class Kv8Case:
    """An 8-bit pool, its scales, and the float case (pool replaced by its dequantized values)."""

    case: object  # kernel_cases.PagedCase; k_pages/v_pages: the dequantized pool, f64 numpy
    k8: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim], int8 or float8_e4m3fn
    v8: jax.Array
    k_scales: jax.Array  # f32[num_kv_heads, num_blocks, block_size]
    v_scales: jax.Array

    def args(self):
        c = self.case
        base = (c.q, self.k8, self.v8, c.block_tables, c.context_lens)
        return base if c.query_start_loc is None else (*base, c.query_start_loc)

    def scales(self):
        return dict(k_scales=self.k_scales, v_scales=self.v_scales)


def dequantized(pages, scales) -> np.ndarray:
    return np.asarray(pages, np.float64) * np.asarray(scales, np.float64)[..., None]


def quantize_case(rng, case, dtype) -> Kv8Case:
    """Write every finite slot of the float case's pool into a stale 8-bit pool via write_kv."""
    k = np.asarray(case.k_pages, np.float32)
    num_kv_heads, num_blocks, block_size, head_dim = k.shape
    shape = k.shape
    if dtype == jnp.int8:
        stale = jnp.asarray(rng.integers(-128, 128, shape), jnp.int8)  # int8 has no NaN
    else:
        stale = jnp.full(shape, jnp.nan, dtype)
    nan_scales = jnp.full(shape[:3], jnp.nan, jnp.float32)
    slots = np.flatnonzero(np.isfinite(k[0, :, :, 0]).reshape(-1)).astype(np.int32)

    def rows(pages):  # the written slots' rows, [n, num_kv_heads, head_dim]
        flat = np.asarray(pages, np.float32).reshape(num_kv_heads, -1, head_dim)
        return jnp.asarray(flat[:, slots].swapaxes(0, 1))

    k8, v8, ks, vs = write_kv(
        stale,
        jnp.array(stale),
        rows(case.k_pages),
        rows(case.v_pages),
        jnp.asarray(slots),
        k_scales=nan_scales,
        v_scales=jnp.array(nan_scales),
    )
    float_case = dataclasses.replace(case, k_pages=dequantized(k8, ks), v_pages=dequantized(v8, vs))
    return Kv8Case(float_case, k8, v8, ks, vs)


def poison_before_window(c: Kv8Case, window: int) -> Kv8Case:
    """NaN scales (and NaN fp8 pages) in every slot before a sequence's earliest window; blocks
    wholly before it -> the null block, as an engine freeing blocks out of the window would."""
    ks, vs = np.array(c.k_scales), np.array(c.v_scales)
    k8, v8 = np.array(c.k8), np.array(c.v8)
    table = np.array(c.case.block_tables)
    block_size = ks.shape[2]
    first = {}
    for _, seq, pos in query_positions(c.case):
        first[seq] = min(first.get(seq, pos), first_key(pos, window))
    for seq, lo in first.items():
        for t in range(lo):
            blk, off = table[seq, t // block_size], t % block_size
            ks[:, blk, off] = vs[:, blk, off] = np.nan
            if c.k8.dtype != jnp.int8:
                k8[:, blk, off] = v8[:, blk, off] = np.nan
        table[seq, : lo // block_size] = 0
    k8, v8, ks, vs = (jnp.asarray(x) for x in (k8, v8, ks, vs))
    case = dataclasses.replace(
        c.case,
        k_pages=dequantized(k8, ks),
        v_pages=dequantized(v8, vs),
        block_tables=jnp.asarray(table),
    )
    return Kv8Case(case, k8, v8, ks, vs)


def make_case(request, layout, kv_dtype) -> Kv8Case:
    rng = fresh_rng(request)
    if layout == "decode":
        case = decode_case(rng, DECODE_LENS, **SHAPE)
    else:
        case = ragged_case(rng, RAGGED_SEQS, pad_rows=2, **SHAPE)
    return quantize_case(rng, case, KV8[kv_dtype])


def attention_fn(c: Kv8Case, layout, backend, *, soft_cap):
    """run(args, scales, window): one jitted call on ``backend`` (kernels in interpret mode), the
    window traced (0: none)."""
    kw = {"backend": "reference"}
    if backend != "reference":
        kw = {**on_backend(backend)[1], "pages_per_block": PAGES_PER_BLOCK}
    if layout == "decode":
        op, extra = paged_attention, {}
    else:
        op, extra = ragged_paged_attention, {"max_query_len": c.case.max_query_len}
        if backend == "tpu":
            kw["block_q"] = 8  # tiles hold rows of several sequences; sequences span tiles

    @jax.jit
    def fn(args, scales, window):
        return op(
            *args,
            scale=c.case.scale,
            sliding_window=window,
            soft_cap=soft_cap,
            **scales,
            **extra,
            **kw,
        )

    def run(args, scales, window):
        ctx = contextlib.nullcontext() if backend == "reference" else on_backend(backend)[0]
        with ctx:
            return fn(args, scales, jnp.int32(window))

    return run


def check(c: Kv8Case, out, *, window, soft_cap) -> float:
    expected = numpy_attention(c.case, window=window, soft_cap=soft_cap)
    assert out.shape == c.case.q.shape
    err = rel_err(out, expected)
    assert err <= TOL, f"window={window} soft_cap={soft_cap}: rel err {err:.2e}"
    rows = [r for r, _, _ in query_positions(c.case)]
    idle = np.setdiff1d(np.arange(c.case.q.shape[0]), rows)
    assert not np.asarray(out)[idle].any(), "rows of no query must come back zero"
    return err


def attention_params():
    """(backend, kv dtype): the references and each kernel for both dtypes; interpret-mode
    kernels beyond one dtype each are slow."""
    fast = {("reference", "int8"), ("reference", "fp8"), ("gpu", "int8"), ("tpu", "fp8")}
    for backend in ("reference", "gpu", "tpu"):
        for kv in KV8:
            marks = () if (backend, kv) in fast else pytest.mark.slow
            yield pytest.param(backend, kv, id=f"{backend}-{kv}", marks=marks)


@pytest.mark.parametrize("backend,kv_dtype", list(attention_params()))
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_attention_over_8bit_pool_matches_dequantized_oracle(
    request, record_error, layout, backend, kv_dtype
):
    """No window, then a sliding window (stale slots before it poisoned), then a soft cap."""
    c = make_case(request, layout, kv_dtype)
    run = attention_fn(c, layout, backend, soft_cap=None)
    errs = [check(c, run(c.args(), c.scales(), 0), window=None, soft_cap=None)]
    windowed = poison_before_window(c, WINDOW)
    out = run(windowed.args(), windowed.scales(), WINDOW)
    errs.append(check(windowed, out, window=WINDOW, soft_cap=None))
    capped = attention_fn(c, layout, backend, soft_cap=SOFT_CAP)
    errs.append(check(c, capped(c.args(), c.scales(), 0), window=None, soft_cap=SOFT_CAP))
    record_error(f"kv8-{layout}-{backend}", kv_dtype, max(errs))


@pytest.mark.parametrize(
    "backend", ["reference", "gpu", pytest.param("tpu", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_bfloat16_queries_over_8bit_pool(request, layout, backend):
    """A bf16 model's queries: the kernels cast the 8-bit pages to bf16 (exact) and the scaled
    probabilities to bf16 (as for a bf16 pool); within bf16 tolerance of the dequantized oracle."""
    c = make_case(request, layout, "int8")
    c = dataclasses.replace(c, case=dataclasses.replace(c.case, q=c.case.q.astype(jnp.bfloat16)))
    out = attention_fn(c, layout, backend, soft_cap=None)(c.args(), c.scales(), 0)
    assert out.dtype == jnp.bfloat16
    expected = numpy_attention(c.case, window=None, soft_cap=None)
    assert rel_err(out, expected) <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("kv_dtype", list(KV8))
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_references_called_directly(request, layout, kv_dtype):
    """The pure-jnp references themselves (not through the entry points), window and cap."""
    c = poison_before_window(make_case(request, layout, kv_dtype), WINDOW)
    attn = dict(scale=c.case.scale, sliding_window=WINDOW, soft_cap=SOFT_CAP, **c.scales())
    if layout == "decode":
        ref = functools.partial(paged_attention_reference, **attn)
    else:
        ref = functools.partial(
            ragged_paged_attention_reference, max_query_len=c.case.max_query_len, **attn
        )
    check(c, jax.jit(ref)(*c.args()), window=WINDOW, soft_cap=SOFT_CAP)


NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = POOL = (2, 6, 4, 16)


@pytest.mark.parametrize("kv_dtype", list(KV8))
def test_write_kv_quantizes_each_row_per_kv_head(request, kv_dtype):
    rng = fresh_rng(request)
    dtype = KV8[kv_dtype]
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    k = jnp.asarray(rng.integers(-100, 100, POOL), dtype)
    v = jnp.asarray(rng.integers(-100, 100, POOL), dtype)
    ks = jnp.asarray(rng.random(POOL[:3]), jnp.float32)
    vs = jnp.asarray(rng.random(POOL[:3]), jnp.float32)
    before = [np.array(x, np.float32) for x in (k, v, ks, vs)]
    slots = np.array([5, -1, 0, 13, -3, NUM_BLOCKS * BLOCK_SIZE - 1], np.int32)
    k_new = rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM)) * 3
    k_new[2, 1] = 0  # a zero row
    k_new[3, 0, 4] = 1e4  # one large element: the rest of its row quantizes coarsely
    v_new = rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM))
    k_new, v_new = jnp.asarray(k_new, jnp.float32), jnp.asarray(v_new, jnp.float32)

    got = write_kv(k, v, k_new, v_new, jnp.asarray(slots), k_scales=ks, v_scales=vs)
    assert len(got) == 4 and k.is_deleted() and ks.is_deleted(), "pool and scales donated"
    ref = write_kv_reference(
        *(jnp.asarray(b).astype(x.dtype) for b, x in zip(before[:2], got[:2], strict=True)),
        k_new,
        v_new,
        jnp.asarray(slots),
        *(jnp.asarray(b) for b in before[2:]),
    )
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    written = {int(s): t for t, s in enumerate(slots) if s >= 0}
    for pages, scales, new, old_p, old_s in (
        (got[0], got[2], k_new, before[0], before[2]),
        (got[1], got[3], v_new, before[1], before[3]),
    ):
        p = np.asarray(pages, np.float64).reshape(NUM_KV_HEADS, -1, HEAD_DIM)
        s = np.asarray(scales, np.float64).reshape(NUM_KV_HEADS, -1)
        old_p = old_p.reshape(NUM_KV_HEADS, -1, HEAD_DIM)
        old_s = old_s.reshape(NUM_KV_HEADS, -1)
        for slot in range(p.shape[1]):
            if slot not in written:  # dropped and untouched slots keep their bytes
                np.testing.assert_array_equal(p[:, slot], old_p[:, slot])
                np.testing.assert_array_equal(s[:, slot], old_s[:, slot])
                continue
            x = np.asarray(new[written[slot]], np.float64)  # [num_kv_heads, head_dim]
            amax = np.abs(x).max(-1)
            want = np.where(amax > 0, amax / qmax, s[:, slot])  # a zero row: any finite scale
            np.testing.assert_allclose(s[:, slot], want, rtol=1e-6)
            assert np.isfinite(s[:, slot]).all() and (s[:, slot] > 0).all()
            deq = p[:, slot] * s[:, slot, None]
            step = s[:, slot, None]
            if kv_dtype == "int8":
                bound = step / 2  # round to nearest
                assert np.abs(p[:, slot]).max() <= 127
            else:  # 3 mantissa bits: relative 2^-4; subnormals: absolute 2^-10 of the scale
                bound = np.maximum(np.abs(x) * 2.0**-4, step * 2.0**-10)
            assert (np.abs(x - deq) <= bound * (1 + 1e-5) + 1e-30).all(), (slot, kv_dtype)
    zero_row = 0  # slot 0 held token 2, whose k head 1 is all zeros
    assert not np.asarray(got[0], np.float32)[1, 0, zero_row].any()


def test_write_kv_without_scales_is_unchanged():
    k = jnp.zeros(POOL)
    out = write_kv(
        k, jnp.zeros(POOL), jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16)), jnp.zeros(1, jnp.int32)
    )
    assert len(out) == 2 and out[0].dtype == jnp.float32


def test_block_ops_move_scales_with_their_blocks(request):
    rng = fresh_rng(request)
    pool = lambda: (
        jnp.asarray(rng.integers(-127, 128, POOL), jnp.int8),
        jnp.asarray(rng.integers(-127, 128, POOL), jnp.int8),
        jnp.asarray(rng.random(POOL[:3]), jnp.float32),
        jnp.asarray(rng.random(POOL[:3]), jnp.float32),
    )
    tree = pool()
    before = [np.array(x) for x in tree]
    src, dst = jnp.array([3, -1, 2, 5], jnp.int32), jnp.array([1, 4, -1, 3], jnp.int32)
    out = copy_blocks(tree, src, dst)
    for b, o in zip(before, out, strict=True):
        want = b.copy()
        want[:, 1], want[:, 3] = b[:, 3], b[:, 5]
        np.testing.assert_array_equal(np.asarray(o), want)
        assert o.dtype == b.dtype

    ids = jnp.array([4, -1, 0], jnp.int32)
    got = gather_blocks(out, ids)
    assert [g.shape for g in got] == [(2, 3, 4, 16)] * 2 + [(2, 3, 4)] * 2
    fresh = pool()
    fresh_np = [np.array(x) for x in fresh]
    back = scatter_blocks(fresh, jnp.array([2, -1, 5], jnp.int32), got)
    for b, o, f in zip(out, back, fresh_np, strict=True):
        want = f.copy()
        want[:, 2], want[:, 5] = np.asarray(b)[:, 4], np.asarray(b)[:, 0]
        np.testing.assert_array_equal(np.asarray(o), want)
        np.testing.assert_array_equal(np.asarray(got[0])[:, 1], 0)  # padding gathers zeros


def _param_aliases(hlo: str) -> set[int]:
    header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
    return {int(p) for p in re.findall(r"\{[\d, ]*\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}


def test_8bit_pool_updates_alias_pages_and_scales():
    pages = jax.ShapeDtypeStruct(POOL, jnp.int8)
    scales = jax.ShapeDtypeStruct(POOL[:3], jnp.float32)
    new = jax.ShapeDtypeStruct((3, 2, 16), jnp.float32)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    hlo = write_kv.lower(pages, pages, new, new, slots, scales, scales).compile().as_text()
    assert {0, 1, 5, 6} <= _param_aliases(hlo)
    ids = jax.ShapeDtypeStruct((4,), jnp.int32)
    hlo = copy_blocks.lower((pages, pages, scales, scales), ids, ids).compile().as_text()
    assert {0, 1, 2, 3} <= _param_aliases(hlo)
    assert not re.search(r"\[2,6,4\]\S* copy\(", hlo), "copy_blocks copies the scales"


def test_8bit_validation_errors():
    q = jnp.zeros((2, 4, 16))
    int8, f32 = jnp.zeros(POOL, jnp.int8), jnp.zeros(POOL)
    scales = jnp.ones(POOL[:3])
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    qsl = jnp.array([0, 1, 2], jnp.int32)
    new, slots = jnp.zeros((3, 2, 16)), jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match="needs k_scales"):
        write_kv(int8, int8, new, new, slots)
    with pytest.raises(ValueError, match="float32"):
        write_kv(f32, f32, new, new, slots, k_scales=scales, v_scales=scales)
    with pytest.raises(ValueError, match=r"float32\[2, 6, 4\]"):
        write_kv(int8, int8, new, new, slots, k_scales=scales[:, :5], v_scales=scales[:, :5])
    with pytest.raises(ValueError, match="together"):
        write_kv(int8, int8, new, new, slots, k_scales=scales)
    with pytest.raises(ValueError, match="needs k_scales"):
        paged_attention(q, int8, int8, table, lens, scale=1.0, backend="reference")
    with pytest.raises(ValueError, match="float32"):
        paged_attention(q, f32, f32, table, lens, scale=1.0, k_scales=scales, v_scales=scales)
    with pytest.raises(ValueError, match="float32"):
        ragged_paged_attention(
            q,
            int8,
            int8,
            table,
            lens,
            qsl,
            scale=1.0,
            k_scales=scales.astype(jnp.bfloat16),
            v_scales=scales,
        )
    with pytest.raises(ValueError, match="both be 8-bit"):
        ragged_paged_attention(q, int8, f32, table, lens, qsl, scale=1.0)
    with pytest.raises(ValueError, match="needs k_scales"):
        ragged_paged_attention(q, int8, int8, table, lens, qsl, scale=1.0)


def test_quantize_kv_fp8_never_overflows_to_nan():
    x = jnp.array([[[448.0, -448.0, 1e-30, 3.0]], [[1e30, 1.0, -1e30, 0.0]]], jnp.float32)
    for dtype in KV8.values():
        q, s = quantize_kv(x, dtype)
        deq = np.asarray(q, np.float64) * np.asarray(s, np.float64)[..., None]
        assert np.isfinite(deq).all()
        np.testing.assert_allclose(np.abs(deq).max(-1), np.abs(np.asarray(x)).max(-1), rtol=1e-6)


@pytest.mark.parametrize(
    "backend", ["reference", "gpu", pytest.param("tpu", marks=pytest.mark.slow)]
)
def test_decode_only_ragged_batch_over_8bit_pool(request, backend):
    """max_query_len 1 takes the decode path of the ragged entry point, scales passed along."""
    rng = fresh_rng(request)
    seqs = [(0, 0), (1, 1), (30, 1), (9, 1), (16, 1)]
    c = quantize_case(rng, ragged_case(rng, seqs, pad_rows=2, **SHAPE), jnp.int8)
    assert c.case.max_query_len == 1
    c = poison_before_window(c, WINDOW)
    run = attention_fn(c, "ragged", backend, soft_cap=SOFT_CAP)
    check(c, run(c.args(), c.scales(), WINDOW), window=WINDOW, soft_cap=SOFT_CAP)


@pytest.mark.parametrize("kv_dtype", list(KV8))
@pytest.mark.parametrize("platform,marker", [("cuda", "triton"), ("tpu", "tpu_custom_call")])
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_8bit_kernels_lower_for_device(platform, marker, layout, kv_dtype):
    """Production-like shapes over an 8-bit pool with a window and a cap, lowered on this CPU."""
    op, args, kw = device_lowering_case(layout, platform, KV8[kv_dtype])
    sds = jax.ShapeDtypeStruct
    scales = sds((4, 1027, 16), jnp.float32)  # [kv_heads, num_blocks, block_size]

    def fn(w, ks, vs, *a):
        return op(*a, sliding_window=w, k_scales=ks, v_scales=vs, **kw)

    traced = jax.jit(fn).trace(sds((), jnp.int32), scales, scales, *args)
    assert marker in traced.lower(lowering_platforms=(platform,)).as_text()
