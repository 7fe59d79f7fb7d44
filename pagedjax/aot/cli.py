"""``pagedjax compile``: will this model, this pool and this batch compile and fit on a v5e-8 or
an H100? Answered on this machine, before renting one: the engine's programs compiled by the
target's own compiler (no weights are read: the model's config gives the shapes)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types

from pagedjax.config import EngineConfig
from pagedjax.engine.arg_utils import EngineArgs
from pagedjax.engine.model_loading import resolved_dtype
from pagedjax.models.config import ModelConfig

from .targets import GIB, TARGETS, Target


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        required=True,
        choices=sorted(TARGETS),
        help="the machine: a TPU slice (needs pagedjax[tpu]) or an NVIDIA GPU (pagedjax[cuda])",
    )
    EngineArgs.add_cli_args(p)
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


def engine_config(args: argparse.Namespace, model: ModelConfig, target: Target) -> EngineConfig:
    """The engine's settings from its flags (``EngineArgs``, as ``serve`` takes them) for
    ``model`` on ``target``: tensor parallel over its chips unless given, and the dtype "auto"
    resolves to as it would there (bfloat16)."""
    if args.tensor_parallel_size is None:
        args.tensor_parallel_size = target.chips
    engine_args = EngineArgs.from_cli_args(args)
    loaded = types.SimpleNamespace(config=model, source=args.model or "default")
    config = engine_args.create_engine_config(loaded)
    dtype = "bfloat16" if args.dtype == "auto" else resolved_dtype(args.dtype)
    return dataclasses.replace(config, dtype=dtype)


def run(args: argparse.Namespace) -> int:
    """Compile, print a table, write JSON if asked; 1 when any program fails (a compile error,
    more memory than a device has, a whole-pool or weight copy, a conditional), else 0."""
    import os

    import jax

    if not os.environ.get("JAX_PLATFORMS"):  # compiling for a target needs no local device
        jax.config.update("jax_platforms", "cpu")
    from pagedjax.models.hf_overrides import apply_hf_overrides

    from .compile import compile_jobs, format_table, select_jobs
    from .kernels import compile_kernel, kernel_matrix
    from .model_config import load_model_config
    from .target_runner import TargetRunner
    from .targets import get_target

    model = load_model_config(args.model, args.revision, args.hf_token)
    model = apply_hf_overrides(model, args.hf_overrides)
    target = get_target(args.target)
    target.devices()  # the compiler's package, or a ValueError naming it
    engine = engine_config(args, model, target)
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
