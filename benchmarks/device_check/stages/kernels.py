"""Stage 2: decode and ragged paged attention on the device against the float32 reference, with
NaN in every stale slot, and JAX's shipped GPU op beside ours."""

from __future__ import annotations

import argparse
import functools
import itertools
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import paged_attention_gpu as decode_bench
from pagedjax.pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

from ..common import TOLERANCE, Budget, Context, fmt_e, say

GQA_HEADS = {1: (2, 2), 4: (8, 2), 8: (16, 2)}  # GQA ratio -> (num_heads, num_kv_heads)


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| in float32; inf if ``out`` holds NaN or inf."""
    return decode_bench.rel_err(jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32))


def note_lowering(ctx: Context, lowerings: dict, name: str, jitted, *args, **kw) -> None:
    """Record once per op which Pallas lowering ``jitted(*args, **kw)`` (not interpreted) takes
    for the device; in an interpreted run, lowered for the device without running."""
    if name in lowerings:
        return
    target = "tpu" if ctx.kernel_backend == "tpu" else "cuda"
    lowered = jitted.trace(*args, **kw).lower(lowering_platforms=(target,))
    found = lowering_of(lowered.as_text())
    lowerings[name] = f"interpret here; lowers to {found} for {target}" if ctx.interpret else found


def lowering_of(lowered_text: str) -> str:
    """Which Pallas lowering a lowered program used, read from its custom calls."""
    found = [
        name
        for name, marker in (
            ("triton", "xla.gpu.triton"),
            ("triton", "triton_kernel_call"),
            ("mosaic_gpu", "mosaic_gpu"),
            ("mosaic_tpu", "tpu_custom_call"),
        )
        if marker in lowered_text
    ]
    return "+".join(dict.fromkeys(found)) or "none (plain XLA)"


def kernel_matrix(full: bool) -> list[tuple[str, str, int, int]]:
    """(kind, dtype, GQA ratio, block size): the full grid, or a subset covering every value."""
    if full:
        return list(
            itertools.product(("decode", "ragged"), ("float32", "bfloat16"), (1, 4, 8), (16, 32))
        )
    return [
        ("decode", "float32", 1, 16),
        ("decode", "bfloat16", 8, 32),
        ("ragged", "bfloat16", 4, 32),
    ]


def context_lengths(rng, num_seqs: int, block_size: int, max_context: int) -> np.ndarray:
    """Lengths ending on and off block boundaries (1, a full block, one past, one short), the
    longest filling all but the last block, the rest random."""
    top = max_context - block_size
    fixed = [top, 1, block_size, block_size + 1, 2 * block_size - 1]
    rand = rng.integers(1, top + 1, max(num_seqs - len(fixed), 0)).tolist()
    return np.asarray((fixed + rand)[:num_seqs], np.int32)


def build_pool(ctx: Context, rng, key, *, dtype, num_kv_heads, block_size, lens):
    """Random K/V pages, block tables into blocks 1.. (padding columns 0), and the same pool with
    NaN in every stale slot and in the null block."""
    s = ctx.sizes
    pages = s.kernel_max_context // block_size
    num_blocks = 1 + len(lens) * pages
    shape = argparse.Namespace(
        num_kv_heads=num_kv_heads, block_size=block_size, head_dim=s.head_dim
    )
    k, v = decode_bench.make_pool(key, shape, num_blocks, jnp.dtype(dtype))
    table = (rng.permutation(num_blocks - 1)[: len(lens) * pages] + 1).reshape(len(lens), pages)
    used = -(-lens // block_size)
    table = np.where(np.arange(pages)[None, :] < used[:, None], table, 0).astype(np.int32)
    table, lens = jnp.asarray(table), jnp.asarray(lens)
    poisoned = (
        decode_bench.poison_stale_slots(k, table, lens),
        decode_bench.poison_stale_slots(v, table, lens),
    )
    return (k, v), poisoned, table, lens


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


@functools.partial(jax.jit, static_argnames=("scale",))
def _decode_ref(q, k, v, table, lens, *, scale):
    return paged_attention_reference(*_f32(q, k, v), table, lens, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale", "max_query_len"))
def _ragged_ref(q, k, v, table, lens, qsl, *, scale, max_query_len):
    return ragged_paged_attention_reference(
        *_f32(q, k, v), table, lens, qsl, scale=scale, max_query_len=max_query_len
    )


def decode_case(ctx, rng, key, dtype, ratio, block_size):
    heads, kv_heads = GQA_HEADS[ratio]
    lens = context_lengths(rng, ctx.sizes.kernel_seqs, block_size, ctx.sizes.kernel_max_context)
    finite, poisoned, table, lens = build_pool(
        ctx, rng, key, dtype=dtype, num_kv_heads=kv_heads, block_size=block_size, lens=lens
    )
    q = jnp.asarray(rng.standard_normal((len(lens), heads, ctx.sizes.head_dim)), dtype)
    return q, finite, poisoned, table, lens


def ragged_case(ctx, rng, key, dtype, ratio, block_size):
    """Prefill, chunked prefill and decode rows in one packed batch, then NaN padding rows."""
    heads, kv_heads = GQA_HEADS[ratio]
    lens = context_lengths(rng, ctx.sizes.kernel_seqs, block_size, ctx.sizes.kernel_max_context)
    q_lens = np.array(
        [[n, min(n, 37), 1][i % 3] for i, n in enumerate(lens.tolist())], np.int32
    )  # whole prompt / a chunk / one token
    finite, poisoned, table, lens = build_pool(
        ctx, rng, key, dtype=dtype, num_kv_heads=kv_heads, block_size=block_size, lens=lens
    )
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pad_rows = 5
    q = rng.standard_normal((int(qsl[-1]) + pad_rows, heads, ctx.sizes.head_dim))
    q[qsl[-1] :] = np.nan
    return jnp.asarray(q, dtype), finite, poisoned, table, lens, jnp.asarray(qsl), int(q_lens.max())


def run(ctx: Context, budget: Budget, data: dict):
    backend, interpret = ctx.kernel_backend, ctx.interpret
    cases = data.setdefault("cases", [])
    lowerings = data.setdefault("lowering", {})
    say(
        f"  backend={backend} interpret={interpret} head_dim={ctx.sizes.head_dim} "
        f"seqs={ctx.sizes.kernel_seqs} max_context={ctx.sizes.kernel_max_context}"
    )
    say("  | op | kind | dtype | GQA | block | rel err | tol | stale NaN -> finite | ok |")
    rng = np.random.default_rng(0)
    matrix = kernel_matrix(ctx.sizes.full_matrix)
    for n, (kind, dtype, ratio, bs) in enumerate(matrix):
        if budget.left() <= 0:
            data["partial"] = f"{n} of {len(matrix)} kernel cases run"
            budget.check(f"kernel case {n + 1} of {len(matrix)}")
        case = dict(kind=kind, dtype=dtype, gqa=ratio, block_size=bs, tol=TOLERANCE[dtype])
        check = check_decode if kind == "decode" else check_ragged
        arrays = guarded(cases, dict(case, op="ours"), check, ctx, rng, n, lowerings)
        if kind == "decode" and backend == "gpu" and arrays is not None:
            guarded(cases, dict(case, op="jax"), check_jax_op, ctx, arrays, lowerings)
    ours = [c for c in cases if c["op"] == "ours"]
    jax_rows = [c for c in cases if c["op"] == "jax"]
    worst = {
        dt: max((c["rel_err"] for c in ours if c["dtype"] == dt and "rel_err" in c), default=None)
        for dt in ("float32", "bfloat16")
    }
    data["max_rel_err"] = worst
    data["mosaic_gpu"] = (
        "not run: pallas_kernels has no Mosaic GPU variant and JAX ships no Mosaic GPU paged "
        "attention (its ops/gpu *_mgpu modules are matmul/attention/collectives)"
    )
    summary = (
        f"ours {sum(c['ok'] for c in ours)}/{len(ours)} within tol (max err f32 "
        f"{fmt_e(worst['float32'])}, bf16 {fmt_e(worst['bfloat16'])}); lowering {lowerings}"
    )
    if jax_rows:
        summary += (
            f"; JAX op on finite pools: {sum(c['ok'] for c in jax_rows)}/{len(jax_rows)} "
            f"within tol, finite with stale NaN: "
            f"{sum(c.get('stale_nan_finite', False) for c in jax_rows)}/{len(jax_rows)}"
        )
    return all(c["ok"] for c in ours), summary


def guarded(cases: list, row: dict, check, *args):
    """Run one case's check, which fills ``row``; an exception fails that case only."""
    cases.append(row)
    try:
        result = check(row, *args)
    except Exception as e:
        row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        say(
            f"  | {row['op']} | {row['kind']} | {row['dtype']} | {row['gqa']} | "
            f"{row['block_size']} | {type(e).__name__}: {str(e)[:200]} |"
        )
        return None
    finite = row.get("finite", row.get("stale_nan_finite"))
    say(
        f"  | {row['op']} | {row['kind']} | {row['dtype']} | {row['gqa']} | {row['block_size']} "
        f"| {row['rel_err']:.1e} | {row['tol']:g} | {finite} | {row['ok']} |"
    )
    return result


def check_decode(row: dict, ctx: Context, rng, n: int, lowerings: dict):
    """Our decode kernel on the poisoned pool vs the reference on the finite one."""
    q, finite, poisoned, table, lens = decode_case(
        ctx, rng, jax.random.key(n), row["dtype"], row["gqa"], row["block_size"]
    )
    scale = ctx.sizes.head_dim**-0.5
    kwargs = dict(scale=scale, backend=ctx.kernel_backend, interpret=ctx.interpret)
    out = paged_attention(q, *poisoned, table, lens, **kwargs)
    ref = _decode_ref(q, *finite, table, lens, scale=scale)
    args = (q, *poisoned, table, lens)
    compiled = dict(kwargs, interpret=False)  # what runs on the device
    note_lowering(ctx, lowerings, "ours/decode", paged_attention, *args, **compiled)
    err = rel_err(out, ref)
    row.update(rel_err=err, finite=bool(np.isfinite(err)), ok=bool(err <= row["tol"]))
    return q, finite, poisoned, table, lens, ref


def check_ragged(row: dict, ctx: Context, rng, n: int, lowerings: dict):
    """Our ragged kernel on the poisoned pool vs the reference; NaN padding rows must be 0."""
    q, finite, poisoned, table, lens, qsl, max_q = ragged_case(
        ctx, rng, jax.random.key(n), row["dtype"], row["gqa"], row["block_size"]
    )
    scale = ctx.sizes.head_dim**-0.5
    kwargs = dict(
        scale=scale, max_query_len=max_q, backend=ctx.kernel_backend, interpret=ctx.interpret
    )
    out = ragged_paged_attention(q, *poisoned, table, lens, qsl, **kwargs)
    ref = _ragged_ref(q, *finite, table, lens, qsl, scale=scale, max_query_len=max_q)
    args = (q, *poisoned, table, lens, qsl)
    compiled = dict(kwargs, interpret=False)
    note_lowering(ctx, lowerings, "ours/ragged", ragged_paged_attention, *args, **compiled)
    err = rel_err(out, ref)
    tail = np.asarray(jnp.asarray(out[int(qsl[-1]) :], jnp.float32))
    pad_ok = bool(np.all(tail == 0))
    row.update(rel_err=err, finite=bool(np.isfinite(err)), padding_rows_zero=pad_ok)
    row["ok"] = bool(err <= row["tol"] and pad_ok)
    return None


def check_jax_op(row: dict, ctx: Context, arrays, lowerings: dict):
    """JAX's shipped GPU op (queries pre-scaled: it applies no scale) on the finite pool, and on
    the poisoned one for whether NaN stays out. A finding about JAX's op, not a failure of ours."""
    q, finite, poisoned, table, lens, ref = arrays
    op = decode_bench.jax_shipped_op(ctx.interpret, table.shape[1])
    qs = (q * ctx.sizes.head_dim**-0.5).astype(q.dtype)
    err = rel_err(op(qs, *finite, table, lens), ref)
    row.update(
        rel_err=err,
        stale_nan_finite=bool(jnp.isfinite(op(qs, *poisoned, table, lens)).all()),
        ok=bool(err <= row["tol"]),
    )
    compiled = decode_bench.jax_shipped_op(False, table.shape[1])
    note_lowering(ctx, lowerings, "jax_op/decode", compiled, qs, *finite, table, lens)
