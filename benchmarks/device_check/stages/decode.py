"""Stage 4: benchmarks/paged_attention_gpu.py at reduced size: achieved bandwidth against a device
copy measured in the same run, and the ratio to JAX's shipped op."""

from __future__ import annotations

import dataclasses

import paged_attention_gpu as decode_bench

from ..common import TOLERANCE, TOY_NOTE, Budget, Context, StageSkipped, fmt_f, say


def run(ctx: Context, budget: Budget, data: dict):
    if ctx.kernel_backend != "gpu":
        raise StageSkipped("the decode benchmark compares GPU kernels")
    args = decode_bench.parse_args(list(ctx.sizes.bench_argv))
    say(f"  benchmarks/paged_attention_gpu.py {' '.join(ctx.sizes.bench_argv)}")
    say(decode_bench.HEADER)
    rows, nan = decode_bench.run(args)
    info = decode_bench.summary(rows, nan)
    data["rows"] = [dataclasses.asdict(r) for r in rows]
    data["summary"] = info
    ok = info["max_err_ours"] < TOLERANCE["bfloat16"] and info["ours_finite"]
    summary = (
        f"copy {info['copy_gbps']:.0f} GB/s; ours at longest context "
        f"{100 * info['min_fraction_of_copy_at_long_context']:.0f}% of copy; x JAX op min "
        f"{fmt_f(info['min_speedup_vs_jax'])}, geomean {fmt_f(info['geomean_speedup_vs_jax'])}; "
        f"max err {info['max_err_ours']:.1e}; stale NaN: ours finite {info['ours_finite']}, "
        f"JAX finite {info.get('jax_finite', '-')}"
    )
    return ok, summary + TOY_NOTE * ctx.interpret
