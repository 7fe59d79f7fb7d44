"""``pagedjax compile``: will this model, this pool and this batch compile and fit on a v5e-8 or
an H100? Answered on this machine, before renting one: the engine's programs compiled by the
target's own compiler (no weights are read: the model's config gives the shapes)."""

from __future__ import annotations

import argparse
import json
import sys

from pagedjax.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from pagedjax.entrypoints.engine_args import add_engine_args, engine_kwargs

from .targets import GIB, TARGETS


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        required=True,
        choices=sorted(TARGETS),
        help="the machine: a TPU slice (needs pagedjax[tpu]) or an NVIDIA GPU (pagedjax[cuda])",
    )
    add_engine_args(p)
    p.add_argument(
        "--programs",
        default="largest",
        choices=("largest", "startup", "all"),
        help="largest: the model steps of the largest decode and prefill shapes (the memory "
        "bound); startup: what a server compiles before it answers; all: every program the "
        "warm-up compiles (default: largest)",
    )
    p.add_argument("--only", default=None, metavar="REGEX", help="programs whose name matches")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="also compile every attention kernel variant (pallas_kernels) for the target",
    )
    p.add_argument(
        "--layer-loop",
        default=None,
        choices=("unrolled", "scan"),
        help="the layers' loop (default: unrolled, the engine's off a CPU)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON here")
    # The whole target by default: a v5e-8 is compiled tensor-parallel over its 8 chips.
    p.set_defaults(func=run, tensor_parallel_size=None)


def engine_config(args: argparse.Namespace, model_context_len: int, chips: int) -> EngineConfig:
    """The engine's settings from the flags (``engine_kwargs``, as ``LLM`` takes them)."""
    kw = engine_kwargs(args)
    cache = ("block_size", "num_blocks", "kv_cache_space_gib", "swap_space_gib")
    cache += ("enable_prefix_caching", "kv_cache_dtype", "gpu_memory_utilization")
    sched = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill")
    return EngineConfig(
        model=args.model or "default",
        dtype=kw["dtype"],
        quantization=kw["quantization"],
        tensor_parallel_size=kw["tensor_parallel_size"] or chips,
        cache=CacheConfig(**{k: kw[k] for k in cache}),
        scheduler=SchedulerConfig(
            max_model_len=resolve_max_model_len(kw["max_model_len"], model_context_len),
            preemption_mode=kw["preemption_mode"],
            **{k: kw[k] for k in sched},
        ),
        speculative_config=kw["speculative_config"],
    )


def run(args: argparse.Namespace) -> int:
    """Compile, print a table, write JSON if asked; 1 when any program fails (a compile error,
    more memory than a device has, a whole-pool or weight copy, a conditional), else 0."""
    import os

    import jax

    if not os.environ.get("JAX_PLATFORMS"):  # compiling for a target needs no local device
        jax.config.update("jax_platforms", "cpu")
    from .compile import compile_jobs, format_table, select_jobs
    from .kernels import compile_kernel, kernel_matrix
    from .model_config import load_model_config
    from .target_runner import TargetRunner
    from .targets import get_target

    model = load_model_config(args.model)
    target = get_target(args.target)
    target.devices()  # the compiler's package, or a ValueError naming it
    engine = engine_config(args, model.max_context_len, target.chips)
    runner = TargetRunner(model, engine, target, args.layer_loop)
    sched = engine.scheduler
    print(
        f"{target.name} ({target.description} x {target.chips}, "
        f"{target.allocator_bytes / GIB:.1f} GiB per device for JAX), tensor parallel "
        f"{engine.tensor_parallel_size}: weights {runner.weight_bytes / GIB:.2f} GiB and a pool "
        f"of {runner.num_blocks} blocks x {runner.block_size} tokens, "
        f"{runner.pool_bytes / GIB:.2f} GiB, per device; layers {runner.layer_loop}, attention "
        f"{runner.backend.name}",
        flush=True,
    )
    jobs = select_jobs(runner, args.programs, sched.max_num_seqs, sched.token_budget, args.only)

    def log(report):
        print(f"  {report.name}: {report.seconds:.1f} s", file=sys.stderr, flush=True)

    reports = compile_jobs(runner, jobs, log=log)
    print(format_table(reports, target.allocator_bytes))
    for r in reports:
        if r.error:
            print(f"\n{r.name}:\n{r.error}")
    kernels = []
    if args.kernels:
        for case in kernel_matrix():
            try:
                compile_kernel(case, target)
                kernels.append((case.name, None))
            except Exception as e:  # the compiler's refusal is the report
                kernels.append((case.name, str(e).strip().splitlines()[0][:200]))
        refused = [(name, err) for name, err in kernels if err]
        print(f"kernels: {len(kernels) - len(refused)} of {len(kernels)} variants compile")
        for name, err in refused:
            print(f"  {name}: {err}")
    if args.json:
        _write_json(args.json, target, runner, reports, kernels)
    failed = [r for r in reports if r.failures(target.allocator_bytes)]
    return 1 if failed or any(err for _, err in kernels) else 0


def _write_json(path: str, target, runner, reports, kernels) -> None:
    data = {
        "target": target.name,
        "device_bytes": target.allocator_bytes,
        "weight_bytes": runner.weight_bytes,
        "pool_bytes": runner.pool_bytes,
        "num_blocks": runner.num_blocks,
        "programs": [r.as_dict() for r in reports],
        "kernels": [{"name": name, "error": err} for name, err in kernels],
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
