"""Decode paged-attention benchmark on one GPU: our kernel vs JAX's shipped Pallas op vs reference.

On the same bfloat16 arrays, for batch x context in {1, 32, 128} x {512, 4096, 32768}:
  * checks correctness on the device (ours and JAX's op against the float32 reference on the
    first few sequences; and, on a pool with NaN in stale slots, whether each stays finite);
  * times our kernel, ``jax.experimental.pallas.ops.gpu.paged_attention`` and the reference;
  * reports achieved bandwidth (K/V bytes read / time) as a fraction of a device-to-device copy's
    (bytes read + written / time) measured in the same run, and the speed-up over JAX's op.
Targets: >= 80% of copy bandwidth at long context, >= 1.3x JAX's op.

    python benchmarks/paged_attention_gpu.py                      # on a GPU (H200: ~3 min)
    python benchmarks/paged_attention_gpu.py --interpret --small  # CPU smoke run (the tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from pagedjax.pallas_kernels import paged_attention, paged_attention_reference  # noqa: E402

BATCHES, CONTEXTS = (1, 32, 128), (512, 4096, 32768)
SMALL_BATCHES, SMALL_CONTEXTS = (1, 3), (48,)
CHECK_SEQS = 4  # sequences checked against the float32 reference per case
REFERENCE_MAX_BYTES = 8 << 30  # skip timing the reference when its gathered context is larger


@dataclasses.dataclass
class Row:
    batch: int
    context: int
    kv_bytes: int
    ours_us: float
    jax_us: float | None
    reference_us: float | None
    ours_err: float
    jax_err: float | None
    copy_gbps: float

    @property
    def ours_gbps(self) -> float:
        return self.kv_bytes / self.ours_us / 1e3

    @property
    def fraction_of_copy(self) -> float:
        return self.ours_gbps / self.copy_gbps

    @property
    def speedup_vs_jax(self) -> float | None:
        return None if self.jax_us is None else self.jax_us / self.ours_us


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--interpret", action="store_true", help="run the Pallas kernels interpreted")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="back-to-back calls per timing")
    p.add_argument("--repeats", type=int, default=5, help="timings per op; the median is kept")
    p.add_argument("--pages-per-block", type=int, help="our kernel's knob (default: its own)")
    p.add_argument("--partition-size", type=int, help="our kernel's knob (default: its own)")
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--skip-jax", action="store_true", help="do not run JAX's shipped op")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if args.small:
        args.batches = args.batches or list(SMALL_BATCHES)
        args.contexts = args.contexts or list(SMALL_CONTEXTS)
        args.num_heads, args.num_kv_heads, args.head_dim = 8, 2, 64
        args.iters, args.repeats = 2, 1
    args.batches = args.batches or list(BATCHES)
    args.contexts = args.contexts or list(CONTEXTS)
    return args


def time_us(fn, *args, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls (async dispatch)."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def copy_bandwidth_gbps(nbytes: int, args) -> float:
    """Device-to-device streaming copy (read + write), the roofline for a memory-bound kernel."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + jnp.ones((), x.dtype))  # one read, one write per element
    us = time_us(copy, x, iters=args.iters, repeats=args.repeats)
    return 2 * x.nbytes / us / 1e3


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def jax_shipped_op(interpret: bool, pages_per_seq: int):
    """JAX's Pallas GPU paged attention, with splits that divide the table as it requires.

    It applies no softmax scale: callers pass queries already multiplied by it.
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    k_splits = max(d for d in range(1, 17) if pages_per_seq % d == 0)
    per_split = pages_per_seq // k_splits
    pages_per_compute_block = max(d for d in range(1, 9) if per_split % d == 0)
    return jax.jit(
        functools.partial(
            jax_paged.paged_attention,
            k_splits=k_splits,
            pages_per_compute_block=pages_per_compute_block,
            interpret=interpret,
        )
    )


def make_pool(key, args, num_blocks, dtype=jnp.bfloat16):
    """Random K and V pages, [num_kv_heads, num_blocks, block_size, head_dim] each."""
    shape = (args.num_kv_heads, num_blocks, args.block_size, args.head_dim)
    kk, kv = jax.random.split(key)
    return jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)


def make_batch(rng, args, batch, context, num_blocks):
    """q, random permuted block tables into blocks 1.., every sequence at full length."""
    pages = context // args.block_size
    q = rng.standard_normal((batch, args.num_heads, args.head_dim), np.float32)
    table = (rng.permutation(num_blocks - 1)[: batch * pages] + 1).reshape(batch, pages)
    return (
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(table, jnp.int32),
        jnp.full((batch,), context, jnp.int32),
    )


@jax.jit
def poison_stale_slots(pages, table, lens):
    """NaN in every slot past each sequence's length and in the null block (stale data)."""
    bs = pages.shape[2]
    pos = jnp.arange(table.shape[1])[:, None] * bs + jnp.arange(bs)[None, :]  # [pages, bs]
    stale = (pos[None] >= lens[:, None, None]).reshape(-1, bs)[None, :, :, None]
    ids = table.reshape(-1)
    pages = pages.at[:, ids].set(jnp.where(stale, jnp.nan, pages[:, ids]))
    return pages.at[:, 0].set(jnp.nan)


def nan_check(args, ours, jax_op, data):
    """Same shapes as a timed case (compiled programs reused), lengths cut mid-block, stale slots
    NaN: does each op keep them out of its output?"""
    q, k, v, table, lens = data
    lens = jnp.maximum(lens - args.block_size - 3, 1)
    k, v = poison_stale_slots(k, table, lens), poison_stale_slots(v, table, lens)
    poisoned = (q, k, v, table, lens)
    result = {"ours_finite": bool(jnp.isfinite(ours(*poisoned)).all())}
    if jax_op is not None:
        result["jax_finite"] = bool(jnp.isfinite(jax_op(*poisoned)).all())
    return result


def run(args) -> tuple[list[Row], dict]:
    scale = args.head_dim**-0.5
    max_pages = max(args.batches) * max(args.contexts) // args.block_size
    num_blocks = max_pages + 1  # block 0 is the null block
    rng = np.random.default_rng(0)
    k_pages, v_pages = make_pool(jax.random.key(0), args, num_blocks)
    copy_gbps = copy_bandwidth_gbps(min(max(k_pages.nbytes, 1 << 20), 2 << 30), args)
    ours = jax.jit(
        functools.partial(
            paged_attention,
            scale=scale,
            backend="gpu",
            interpret=args.interpret,
            pages_per_block=args.pages_per_block,
            partition_size=args.partition_size,
            num_warps=args.num_warps,
            num_stages=args.num_stages,
        )
    )
    reference = jax.jit(functools.partial(paged_attention_reference, scale=scale))
    rows, nan = [], None
    for batch in args.batches:
        for context in args.contexts:
            q, table, lens = make_batch(rng, args, batch, context, num_blocks)
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * 2
            data = (q, k_pages, v_pages, table, lens)
            out = ours(*data)
            n = min(batch, CHECK_SEQS)
            # float32 queries; the reference upcasts the gathered pages to float32 itself.
            ref = reference(q[:n].astype(jnp.float32), k_pages, v_pages, table[:n], lens[:n])
            ours_err = rel_err(out[:n], ref)
            timing = dict(iters=args.iters, repeats=args.repeats)
            ours_us = time_us(ours, *data, **timing)
            jax_us = jax_err = jax_op = None
            if not args.skip_jax:
                jax_op = jax_shipped_op(args.interpret, context // args.block_size)
                jax_data = ((q * scale).astype(q.dtype), *data[1:])
                jax_err = rel_err(jax_op(*jax_data)[:n], ref)
                jax_us = time_us(jax_op, *jax_data, **timing)
            ref_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * 4
            reference_us = (
                time_us(reference, *data, **timing) if ref_bytes <= REFERENCE_MAX_BYTES else None
            )
            rows.append(
                Row(
                    batch,
                    context,
                    kv_bytes,
                    ours_us,
                    jax_us,
                    reference_us,
                    ours_err,
                    jax_err,
                    copy_gbps,
                )
            )
            print(format_row(rows[-1]), flush=True)
            if nan is None:
                nan = nan_check(args, ours, jax_op, data)
    return rows, nan


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


HEADER = (
    "| batch | context | KV MiB | ours us | ours GB/s | % of copy | JAX us | x JAX | ref us "
    "| err ours | err JAX |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(r: Row) -> str:
    return (
        f"| {r.batch} | {r.context} | {r.kv_bytes / 2**20:.1f} | {r.ours_us:.1f} | "
        f"{r.ours_gbps:.0f} | {100 * r.fraction_of_copy:.0f}% | {fmt(r.jax_us, '.1f')} | "
        f"{fmt(r.speedup_vs_jax, '.2f')} | {fmt(r.reference_us, '.1f')} | {r.ours_err:.1e} | "
        f"{fmt(r.jax_err, '.1e')} |"
    )


def summary(rows: list[Row], nan: dict) -> dict:
    long_ctx = max(r.context for r in rows)
    long_rows = [r for r in rows if r.context == long_ctx]
    speedups = [r.speedup_vs_jax for r in rows if r.speedup_vs_jax is not None]
    return {
        "device": str(jax.devices()[0].device_kind),
        "copy_gbps": rows[0].copy_gbps,
        "min_fraction_of_copy_at_long_context": min(r.fraction_of_copy for r in long_rows),
        "min_speedup_vs_jax": min(speedups) if speedups else None,
        "geomean_speedup_vs_jax": (
            math.exp(statistics.mean(math.log(s) for s in speedups)) if speedups else None
        ),
        "max_err_ours": max(r.ours_err for r in rows),
        **nan,
    }


def main(argv=None) -> tuple[list[Row], dict]:
    args = parse_args(argv)
    if not args.interpret and jax.default_backend() != "gpu":
        raise SystemExit("no GPU here: run with --interpret --small for a CPU smoke run")
    print(
        f"device={jax.devices()[0].device_kind} heads={args.num_heads}/{args.num_kv_heads} "
        f"head_dim={args.head_dim} block_size={args.block_size} bfloat16"
    )
    print(HEADER)
    rows, nan = run(args)
    info = summary(rows, nan)
    print(
        f"copy {info['copy_gbps']:.0f} GB/s; at long context ours reaches "
        f"{100 * info['min_fraction_of_copy_at_long_context']:.0f}% of it (target >= 80%); "
        f"speed-up vs JAX's op: min {fmt(info['min_speedup_vs_jax'], '.2f')}, geomean "
        f"{fmt(info['geomean_speedup_vs_jax'], '.2f')} (target >= 1.3); NaN-stale check: {nan}"
    )
    if args.json:
        payload = {"rows": [dataclasses.asdict(r) for r in rows], "summary": info}
        args.json.write_text(json.dumps(payload, indent=2))
    return rows, info


if __name__ == "__main__":
    main()
