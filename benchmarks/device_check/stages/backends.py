"""Stage 2b: every attention backend of this platform against a float64 oracle, and a bandwidth
table per backend.

Backends: on a GPU "triton" and "reference" (XLA's gathers; "mosaic" is recorded as refused
until it exists); on a TPU "tpu" and "reference"; on a CPU (--toy) "native" and "reference", and
"triton" / "tpu" in interpret mode. Each runs decode and ragged (prefill, chunked prefill and
decode rows packed, NaN padding rows that must come back zero) through the backend object
(``select_backend``), on pools with NaN in every stale slot and in the null block (an 8-bit pool:
NaN scales there, and NaN pages for float8). The cases cover GQA 1/4/8, blocks 16/32, head dims
64/128/256, float32 and bfloat16, a sliding window, a soft cap and int8 / float8 KV, each varied
from one base case. The oracle is numpy in float64 over the same (rounded, dequantized) values.

Bandwidth: decode at a few (batch, context) shapes per backend, live K/V bytes read / time, as a
fraction of a device copy measured in the same run (benchmarks/paged_attention_gpu.py's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import paged_attention_gpu as decode_bench
from pagedjax.pallas_kernels import (
    AttentionMetadata,
    AttentionOptions,
    PagedKV,
    quantize_kv,
    select_backend,
)

from ..common import TOLERANCE, TOY_NOTE, Budget, Context, fmt_e, say

GQA_HEADS = {1: (2, 2), 4: (8, 2), 8: (16, 2)}  # GQA ratio -> (num_heads, num_kv_heads)
WINDOW, SOFT_CAP = 19, 2.0  # a window off block boundaries; a cap that bends N(0, 1) logits
KV8 = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str = "decode"  # or "ragged"
    dtype: str = "bfloat16"
    gqa: int = 4
    block_size: int = 16
    head_dim: int = 128
    variant: str = "plain"  # "window", "soft_cap", "int8", "fp8"


def cases(short: bool) -> list[Case]:
    """From a base case, each axis varied alone, for decode and ragged; ``short``: a few for a
    toy run on a CPU (interpreted kernels)."""
    if short:
        return [
            Case(kind=k, dtype="float32", head_dim=64, variant=v)
            for k in ("decode", "ragged")
            for v in ("plain", "window", "int8")
        ]
    axes = dict(
        dtype=("float32",),
        gqa=(1, 8),
        block_size=(32,),
        head_dim=(64, 256),
        variant=("window", "soft_cap", "int8", "fp8"),
    )
    out = []
    for kind in ("decode", "ragged"):
        out.append(Case(kind=kind))
        out += [Case(kind=kind, **{a: v}) for a, values in axes.items() for v in values]
        out.append(Case(kind=kind, dtype="float32", gqa=8, head_dim=256, variant="soft_cap"))
    return out


def platform_backends(ctx: Context) -> list[tuple[str, bool]]:
    """(backend name, interpret) for this platform."""
    if ctx.platform == "gpu":
        return [("triton", False), ("reference", False)]
    if ctx.platform == "tpu":
        return [("tpu", False), ("reference", False)]
    return [("native", False), ("reference", False), ("triton", True), ("tpu", True)]


def build(rng, case: Case, lens: np.ndarray, q_lens: np.ndarray | None):
    """Arrays for one case: (q, PagedKV with stale slots poisoned, metadata, the float64 values
    the oracle reads: q, k, v pages dequantized)."""
    heads, kv_heads = GQA_HEADS[case.gqa]
    bs, d = case.block_size, case.head_dim
    pages = -(-int(lens.max()) // bs) + 1  # one padding column
    num_blocks = 1 + len(lens) * pages
    table = (rng.permutation(num_blocks - 1)[: len(lens) * pages] + 1).reshape(len(lens), pages)
    table = np.where(np.arange(pages)[None] < -(-lens // bs)[:, None], table, 0).astype(np.int32)
    live = np.zeros((num_blocks, bs), bool)  # slots below some sequence's length
    for s, n in enumerate(lens):
        for t in range(int(n)):
            live[table[s, t // bs], t % bs] = True
    dt = jnp.dtype(case.dtype)
    k, v = (rng.standard_normal((kv_heads, num_blocks, bs, d)) for _ in range(2))
    if case.variant in KV8:
        kv, exact = _quantized(k, v, KV8[case.variant], live)
    else:
        k, v = (np.asarray(jnp.asarray(x, dt).astype(jnp.float32), np.float64) for x in (k, v))
        stale = lambda x: jnp.asarray(np.where(live[None, :, :, None], x, np.nan), dt)  # noqa: E731
        kv, exact = PagedKV(stale(k), stale(v)), (k, v)
    rows = len(lens) if q_lens is None else int(q_lens.sum()) + 3  # 3 NaN padding rows
    q = np.array(jnp.asarray(rng.standard_normal((rows, heads, d)), dt).astype(jnp.float32))
    qsl = None if q_lens is None else np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    if qsl is not None:
        q[qsl[-1] :] = np.nan
    md = AttentionMetadata(
        jnp.asarray(table),
        jnp.asarray(lens, jnp.int32),
        None if qsl is None else jnp.asarray(qsl),
        max_query_len=None if q_lens is None else int(q_lens.max()),
    )
    return jnp.asarray(q, dt), kv, md, (np.asarray(q, np.float64), *exact)


def _quantized(k, v, dtype, live):
    """An 8-bit pool from float pages (write_kv's per-token quantization) with NaN scales (and
    NaN float8 pages) in stale slots, and its exact dequantized values."""
    kv_heads, num_blocks, bs, d = k.shape
    out, exact = [], []
    for x in (k, v):
        rows = jnp.asarray(x.reshape(kv_heads, -1, d).swapaxes(0, 1), jnp.float32)
        pages8, scales = quantize_kv(rows, dtype)  # [slots, kv_heads, d], [slots, kv_heads]
        pages8 = pages8.swapaxes(0, 1).reshape(x.shape)
        scales = np.asarray(scales).T.reshape(kv_heads, num_blocks, bs)
        exact.append(np.asarray(pages8.astype(jnp.float32), np.float64) * scales[..., None])
        if dtype != jnp.int8:  # float8 holds NaN: poison the pages too
            pages8 = jnp.where(live[None, :, :, None], pages8, jnp.nan).astype(dtype)
        out.append((pages8, jnp.asarray(np.where(live[None], scales, np.nan), jnp.float32)))
    (kp, ks), (vp, vs) = out
    return PagedKV(kp, vp, ks, vs), tuple(exact)


def oracle(exact, md: AttentionMetadata, opts: AttentionOptions) -> np.ndarray:
    """float64 attention over live slots only: [rows, heads, head_dim], zeros for padding rows."""
    q, k, v = exact
    table, lens = np.asarray(md.block_tables), np.asarray(md.context_lens)
    kv_heads, _, bs, d = k.shape
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    qsl = None if md.query_start_loc is None else np.asarray(md.query_start_loc)
    window = 0 if opts.sliding_window is None else int(opts.sliding_window)
    for s, n in enumerate(lens):
        rows = [s] if qsl is None else list(range(qsl[s], qsl[s + 1]))
        if n == 0 or not rows:
            continue
        ids = table[s, : -(-n // bs)]
        ks = k[:, ids].reshape(kv_heads, -1, d)[:, :n]  # [kv_heads, n, d]
        vs = v[:, ids].reshape(kv_heads, -1, d)[:, :n]
        for j, r in enumerate(rows):
            pos = n - len(rows) + j
            lo = max(0, pos - window + 1) if window > 0 else 0
            qh = q[r].reshape(kv_heads, group, d)
            s_ = np.einsum("kgd,ktd->kgt", qh, ks[:, lo : pos + 1]) * opts.scale
            if opts.soft_cap is not None:
                s_ = opts.soft_cap * np.tanh(s_ / opts.soft_cap)
            p = np.exp(s_ - s_.max(-1, keepdims=True))
            o = np.einsum("kgt,ktd->kgd", p / p.sum(-1, keepdims=True), vs[:, lo : pos + 1])
            out[r] = o.reshape(-1, d)
    return out


def check_case(backend, case: Case, sizes, rng) -> dict:
    lens = decode_lengths(rng, sizes["seqs"], case.block_size, sizes["max_context"])
    q_lens = None
    if case.kind == "ragged":  # whole prompts, chunks, single rows
        q_lens = np.array([[n, min(n, 37), 1][i % 3] for i, n in enumerate(lens)], np.int32)
        q_lens = np.minimum(q_lens, lens)
    q, kv, md, exact = build(rng, case, lens, q_lens)
    opts = AttentionOptions(
        case.head_dim**-0.5,
        WINDOW if case.variant == "window" else None,
        SOFT_CAP if case.variant == "soft_cap" else None,
    )
    out = np.asarray(jax.jit(backend.attend)(q, kv, md, opts).astype(jnp.float32), np.float64)
    want = oracle(exact, md, opts)
    err = decode_bench.rel_err(out, want)
    padding_zero = md.query_start_loc is None or not out[int(md.query_start_loc[-1]) :].any()
    tol = TOLERANCE[case.dtype]
    return dict(
        dataclasses.asdict(case),
        rel_err=err,
        tol=tol,
        padding_rows_zero=bool(padding_zero),
        ok=bool(err <= tol and padding_zero),
    )


def decode_lengths(rng, num_seqs: int, block_size: int, max_context: int) -> np.ndarray:
    """On and off block boundaries, 0 (an empty slot), and random ones up to ``max_context``."""
    fixed = [max_context, 1, block_size, block_size + 1, 0, 2 * block_size - 1]
    rand = rng.integers(1, max_context + 1, max(num_seqs - len(fixed), 0)).tolist()
    return np.asarray((fixed + rand)[:num_seqs], np.int32)


def correctness(ctx: Context, budget: Budget, data: dict) -> list[dict]:
    rows = data.setdefault("cases", [])
    sizes = dict(seqs=3, max_context=48) if ctx.interpret else dict(seqs=8, max_context=700)
    say("  | backend | kind | dtype | GQA | block | head_dim | variant | rel err | tol | ok |")
    for name, interpret in platform_backends(ctx):
        backend = select_backend(name, interpret=interpret)
        for case in cases(short=ctx.interpret):
            budget.check(f"{name} {case}")
            rng = np.random.default_rng(len(rows))
            try:
                row = dict(check_case(backend, case, sizes, rng), backend=name)
            except Exception as e:  # one case fails, the rest still run
                row = dict(dataclasses.asdict(case), backend=name, ok=False, error=repr(e)[:300])
            rows.append(row)
            c = case
            say(
                f"  | {name} | {c.kind} | {c.dtype} | {c.gqa} | {c.block_size} | {c.head_dim} | "
                f"{c.variant} | {fmt_e(row.get('rel_err'))} | {row.get('tol', '-')} | "
                f"{row['ok']}{'' if 'error' not in row else ' ' + row['error'][:120]} |"
            )
    return rows


def bandwidth(ctx: Context, budget: Budget, data: dict) -> list[dict]:
    """Decode over bfloat16 pools of a Llama-3-8B layer (32 heads, 8 KV heads, head_dim 128)."""
    toy = ctx.interpret
    shapes = [(2, 64)] if toy else [(8, 1024), (8, 2048), (32, 1024), (64, 2048)]
    heads, kv_heads, d, bs = (8, 2, 32, 16) if toy else (32, 8, 128, 16)
    timing = argparse.Namespace(iters=2 if toy else 20, repeats=2 if toy else 5)
    copy = decode_bench.copy_bandwidth_gbps(64 << 20 if toy else 1 << 30, timing)
    data["copy_gbps"] = copy
    rows = data.setdefault("bandwidth", [])
    say(f"  device copy {copy:.0f} GB/s")
    say("  | backend | batch | context | us | GB/s | of copy |")
    for name, interpret in platform_backends(ctx):
        if interpret:
            continue  # an interpreted kernel's time says nothing
        backend = select_backend(name)
        for batch, context in shapes:
            budget.check(f"bandwidth {name} {batch}x{context}")
            rng = np.random.default_rng(batch * context)
            pages = context // bs
            table = (rng.permutation(batch * pages) + 1).reshape(batch, pages).astype(np.int32)
            pool = jax.random.normal(jax.random.key(0), (kv_heads, batch * pages + 1, bs, d))
            kv = PagedKV(pool.astype(jnp.bfloat16), pool.astype(jnp.bfloat16))
            md = AttentionMetadata(jnp.asarray(table), jnp.full((batch,), context, jnp.int32))
            q = jnp.ones((batch, heads, d), jnp.bfloat16)
            fn = jax.jit(functools.partial(backend.decode, opts=AttentionOptions(d**-0.5)))
            us = decode_bench.time_us(fn, q, kv, md, iters=timing.iters, repeats=timing.repeats)
            nbytes = 2 * batch * context * kv_heads * d * 2 + 2 * q.nbytes
            gbps = nbytes / us / 1e3
            rows.append(dict(backend=name, batch=batch, context=context, us=us, gbps=gbps))
            rows[-1]["fraction_of_copy"] = gbps / copy
            say(f"  | {name} | {batch} | {context} | {us:.1f} | {gbps:.0f} | {gbps / copy:.2f} |")
    return rows


def run(ctx: Context, budget: Budget, data: dict):
    try:
        select_backend("mosaic")
    except ValueError as e:
        data["mosaic"] = f"refused: {e}"
    rows = correctness(ctx, budget, data)
    bw = bandwidth(ctx, budget, data)
    failed = [r for r in rows if not r["ok"]]
    worst = {
        dt: max((r["rel_err"] for r in rows if r["dtype"] == dt and "rel_err" in r), default=None)
        for dt in ("float32", "bfloat16")
    }
    by_backend = {}
    for r in bw:
        by_backend.setdefault(r["backend"], []).append(r["fraction_of_copy"])
    summary = (
        f"{len(rows) - len(failed)}/{len(rows)} cases within tol (max err f32 "
        f"{fmt_e(worst['float32'])}, bf16 {fmt_e(worst['bfloat16'])}); decode of copy: "
        + ", ".join(f"{b} {min(v):.2f}-{max(v):.2f}" for b, v in by_backend.items())
    )
    return not failed, summary + TOY_NOTE * ctx.interpret
