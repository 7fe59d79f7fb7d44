"""Sliding-window attention and logit soft-capping, in every attention path, against float64 numpy.

A query at position p sees keys ``p - window < k <= p`` (Hugging Face's semantics; window <= 0:
no window); logits ``s = scale * q.k`` become ``cap * tanh(s / cap)`` before the softmax. Pools
start all-NaN, and every slot before a sequence's earliest window is poisoned again, with the
table entries of blocks wholly before it pointed at the (NaN) null block, as an engine that frees
blocks out of the window would leave them. The window is a traced argument of one jitted call per
(path, backend, soft_cap), run with windows smaller than a block, spanning several blocks, longer
than the context, and 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    PAGES_PER_BLOCK,
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
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

BLOCK_SIZE = 8
SHAPE = dict(num_heads=4, num_kv_heads=2, block_size=BLOCK_SIZE, head_dim=32, dtype=jnp.float32)
# Smaller than a block, several blocks, longer than every context, 0 (a global layer).
WINDOWS = (5, 19, 1000, 0)
SOFT_CAP = 2.0  # logits here are about N(0, 1): a cap of 2 bends them visibly
TOL = 2e-5
DECODE_LENS = [0, 1, 4, 8, 9, 23, 40, 57]
# (context_len, query_len): whole prompts, a chunk of a chunked prefill, a prefix-cache hit, an
# empty slot, decodes.
RAGGED_SEQS = [(21, 13), (40, 6), (53, 2), (0, 0), (1, 1), (30, 1), (9, 9)]
DECODE_ONLY_SEQS = [(0, 0), (1, 1), (30, 1), (9, 1), (57, 1)]  # max_query_len 1


def poison_before_windows(case, window):
    """NaN in every slot no query of a sequence sees; blocks wholly before it -> null block."""
    k = np.array(case.k_pages)
    v = np.array(case.v_pages)
    table = np.array(case.block_tables)
    block_size = k.shape[2]
    first = {}
    for _, seq, pos in query_positions(case):
        first[seq] = min(first.get(seq, pos), first_key(pos, window))
    for seq, lo in first.items():
        for t in range(lo):
            k[:, table[seq, t // block_size], t % block_size] = np.nan
            v[:, table[seq, t // block_size], t % block_size] = np.nan
        table[seq, : lo // block_size] = 0
    return dataclasses.replace(
        case, k_pages=jnp.asarray(k), v_pages=jnp.asarray(v), block_tables=jnp.asarray(table)
    )


def make_case(request, layout):
    rng = fresh_rng(request)
    if layout == "decode":
        return decode_case(rng, DECODE_LENS, **SHAPE)
    seqs = RAGGED_SEQS if layout == "ragged" else DECODE_ONLY_SEQS
    return ragged_case(rng, seqs, pad_rows=2, **SHAPE)


def attention_fn(case, layout, backend, *, soft_cap, windowed=True):
    """run(args, window): one jitted call, the window its traced argument (as inside a scan over
    layers), on ``backend`` (kernels in interpret mode)."""
    kw = {"backend": "reference"}
    if backend != "reference":
        kw = {**on_backend(backend)[1], "pages_per_block": PAGES_PER_BLOCK}
    if layout == "decode":
        op, extra = paged_attention, {}
    else:
        op, extra = ragged_paged_attention, {"max_query_len": case.max_query_len}
        if backend == "tpu":
            kw["block_q"] = 8  # tiles hold rows of several sequences; sequences span tiles

    @jax.jit
    def fn(args, window):
        return op(
            *args,
            scale=case.scale,
            sliding_window=window if windowed else None,
            soft_cap=soft_cap,
            **extra,
            **kw,
        )

    def run(args, window):
        ctx = contextlib.nullcontext() if backend == "reference" else on_backend(backend)[0]
        with ctx:
            return fn(args, window)

    return run


def check(case, out, *, window, soft_cap):
    expected = numpy_attention(case, window=window, soft_cap=soft_cap)
    assert out.shape == case.q.shape
    err = rel_err(out, expected)
    assert err <= TOL, f"window={window} soft_cap={soft_cap}: rel err {err:.2e}"
    rows = [r for r, _, _ in query_positions(case)]
    idle = np.setdiff1d(np.arange(case.q.shape[0]), rows)
    assert not np.asarray(out)[idle].any(), "rows of no query must come back zero"


def window_params():
    """(backend, soft_cap): every backend with the cap (all windows, and window with cap); the
    kernels without it are a slow extra (the window-only path is also run by the reference)."""
    for backend in ("reference", "gpu", "tpu"):
        for cap, name in ((SOFT_CAP, "window+cap"), (None, "window")):
            slow = backend != "reference" and cap is None
            marks = pytest.mark.slow if slow else ()
            yield pytest.param(backend, cap, id=f"{backend}-{name}", marks=marks)


@pytest.mark.parametrize("backend,soft_cap", list(window_params()))
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_sliding_window_is_a_traced_argument(request, layout, backend, soft_cap):
    case = make_case(request, layout)
    run = attention_fn(case, layout, backend, soft_cap=soft_cap)
    for window in WINDOWS:
        poisoned = poison_before_windows(case, window)
        out = run(poisoned.args(), jnp.int32(window))
        check(poisoned, out, window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("backend", ["reference", "gpu", "tpu"])
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_soft_cap_alone(request, layout, backend):
    case = make_case(request, layout)
    run = attention_fn(case, layout, backend, soft_cap=SOFT_CAP, windowed=False)
    check(case, run(case.args(), None), window=None, soft_cap=SOFT_CAP)


@pytest.mark.parametrize(
    "backend", ["reference", "gpu", pytest.param("tpu", marks=pytest.mark.slow)]
)
def test_decode_only_ragged_batch_with_window_and_cap(request, backend):
    """max_query_len 1 takes the decode path of the ragged entry point."""
    case = make_case(request, "ragged-decode")
    assert case.max_query_len == 1
    run = attention_fn(case, "ragged", backend, soft_cap=SOFT_CAP)
    for window in (5, 0):
        poisoned = poison_before_windows(case, window)
        check(poisoned, run(poisoned.args(), jnp.int32(window)), window=window, soft_cap=SOFT_CAP)


@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_references_take_a_python_int_window(request, layout):
    """A plain int window (a constant, not traced) and a float cap, the references jitted as is."""
    case = poison_before_windows(make_case(request, layout), 19)
    attn = dict(scale=case.scale, sliding_window=19, soft_cap=SOFT_CAP)
    if layout == "decode":
        ref = functools.partial(paged_attention_reference, **attn)
    else:
        ref = functools.partial(
            ragged_paged_attention_reference, max_query_len=case.max_query_len, **attn
        )
    check(case, jax.jit(ref)(*case.args()), window=19, soft_cap=SOFT_CAP)


@pytest.mark.parametrize("platform,marker", [("cuda", "triton"), ("tpu", "tpu_custom_call")])
@pytest.mark.parametrize("layout", ["decode", "ragged"])
def test_windowed_capped_kernels_lower_for_device(platform, marker, layout):
    """Production-like shapes with a traced window and a cap, lowered on this CPU."""
    op, args, kw = device_lowering_case(layout, platform, jnp.bfloat16)
    sds = jax.ShapeDtypeStruct
    traced = jax.jit(lambda w, *a: op(*a, sliding_window=w, **kw)).trace(sds((), jnp.int32), *args)
    assert marker in traced.lower(lowering_platforms=(platform,)).as_text()


def test_window_and_cap_validation():
    q = jnp.zeros((2, 4, 32))
    pages = jnp.zeros((2, 4, 8, 32))
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    qsl = jnp.array([0, 1, 2], jnp.int32)
    for bad in (jnp.ones((2,), jnp.int32), 4.0, jnp.float32(4)):
        with pytest.raises(ValueError, match="sliding_window"):
            paged_attention(q, pages, pages, table, lens, scale=1.0, sliding_window=bad)
    for bad in (0.0, -1.0, "2"):
        with pytest.raises(ValueError, match="soft_cap"):
            ragged_paged_attention(q, pages, pages, table, lens, qsl, scale=1.0, soft_cap=bad)
