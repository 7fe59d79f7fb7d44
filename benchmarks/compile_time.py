"""Compile time of the engine's programs, in one run on one machine (check the load first).

1. Seconds to trace, lower and compile each model-step program for the model (default: the
   embedded SmolLM2-135M, 30 layers), with the layers under scan and unrolled (one parameter tree
   and one copy of the layer per layer, models/layer_loop.py), with the persistent compilation
   cache off.
2. ``pagedjax generate`` wall time in a fresh process: with warm caches (converted parameters and
   compiled programs) and with the compilation cache deleted (parameters still cached).
3. Programs compiled after ``LLM(..., warmup=True)``: by a first request with penalties and
   logprobs, then by a mixed workload (n > 1, beams, logprobs, penalties, shared prefixes,
   preemption by swapping). Both must be 0.

    python benchmarks/compile_time.py [--model PATH] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def load() -> float:
    return os.getloadavg()[0]


def step_programs(model: str | None, repeats: int) -> list[dict]:
    """Compile seconds per step program, scan vs unrolled, persistent cache off."""
    import jax
    from pagedjax.models.layer_loop import split_layers
    from pagedjax.models.llama import forward, param_shapes

    from pagedjax import LLM
    from pagedjax.worker.runner import ScheduledSeq, StepShape
    from pagedjax.worker.sampler import SamplingRow

    llm = LLM(model, max_model_len=2048, max_num_seqs=64)
    r = llm.runner
    # The unrolled step's parameters: one tree per layer (shapes suffice to compile)
    dtype = jax.tree.leaves(r.params)[0].dtype.name
    unrolled = split_layers(param_shapes(r.config, dtype), r.config)
    layouts = {False: (r.params, r.linear), True: (unrolled, None)}
    shapes = [
        ("decode", [ScheduledSeq([5], 3, [1], [SamplingRow()])]),
        ("prefill 5 tokens", [ScheduledSeq([5] * 5, 0, [1], [SamplingRow()])]),
        ("prefill 200 tokens", [ScheduledSeq([5] * 200, 0, list(range(1, 14)), [SamplingRow()])]),
    ]
    results = []
    for name, seqs in shapes:
        step_input = r.build_step_input(seqs)
        shape = StepShape(
            len(step_input.token_ids), *step_input.block_tables.shape, step_input.max_query_len
        )
        for unroll in (False, True):
            times = []
            for _ in range(repeats):
                # A fresh function each time: nothing cached in memory (the disk cache is off).
                def fresh(*args):
                    return forward(*args)

                fn = jax.jit(fresh, static_argnums=(3, 4, 5, 6), donate_argnums=(1,))
                params, linear = layouts[unroll]
                loadavg = load()
                t0 = time.perf_counter()
                lowered = fn.lower(
                    params,
                    r.kv_cache.pages,
                    jax.device_put(step_input),
                    r.config,
                    r.backend,
                    r.mesh,
                    linear,
                )
                t1 = time.perf_counter()
                lowered.compile()
                t2 = time.perf_counter()
                times.append((t1 - t0, t2 - t1, loadavg))
            total = [a + b for a, b, _ in times]
            results.append(
                {
                    "program": f"{name} ({shape})",
                    "layers": "unrolled" if unroll else "scan",
                    "trace_lower_s": min(a for a, _, _ in times),
                    "compile_s": min(b for _, b, _ in times),
                    "total_min_s": min(total),
                    "total_median_s": statistics.median(total),
                    "load": max(x for _, _, x in times),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    llm.close()
    return results


def generate_wall(model: str | None, repeats: int, cache_root: Path) -> dict:
    """Wall time of `pagedjax generate` in fresh processes sharing ``cache_root``."""
    cmd = [sys.executable, "-m", "pagedjax.cli", "generate", "--prompt", PROMPT]
    cmd += ["--max-tokens", "48"] + (["--model", model] if model else [])
    env = {**os.environ, "PAGEDJAX_CACHE_DIR": str(cache_root)}
    env.pop("PAGEDJAX_COMPILATION_CACHE", None)

    def run() -> tuple[float, float]:
        loadavg = load()
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True)
        return time.perf_counter() - t0, loadavg

    run()  # converts and caches the parameters, compiles and caches the programs
    cold, warm = [], []
    for _ in range(repeats):
        shutil.rmtree(cache_root / "jax", ignore_errors=True)
        cold.append(run())
        warm.append(run())
    out = {}
    for name, runs in (("compilation_cache_deleted", cold), ("warm_caches", warm)):
        secs = [s for s, _ in runs]
        out[name] = {
            "min_s": min(secs),
            "median_s": statistics.median(secs),
            "load": max(x for _, x in runs),
        }
    print(json.dumps(out), flush=True)
    return out


def after_warmup(model: str | None) -> dict:
    """Programs compiled after warm-up: by a first penalties + logprobs request, then by a
    mixed workload."""
    import numpy as np

    from pagedjax import LLM, BeamSearchParams, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        num_blocks=32,
        preemption_mode="swap",
        swap_space_gib=0.05,
        warmup=True,
    )
    build_s = time.perf_counter() - t0
    warm = llm.get_stats()
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(100, 20000, n).tolist()  # noqa: E731
    first = SamplingParams(max_tokens=8, repetition_penalty=1.2, presence_penalty=0.5, logprobs=5)
    llm.generate([prompt(30)], first, use_tqdm=False)
    after_first = llm.get_stats().num_compilations - warm.num_compilations
    shared = prompt(40)
    prompts = [prompt(int(n)) for n in rng.integers(1, 120, 14)] + [shared + [7], shared + [8]]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 40)),
            temperature=float(rng.choice([0.0, 0.8])),
            top_p=float(rng.choice([1.0, 0.9])),
            n=int(rng.choice([1, 1, 2])),
            logprobs=int(rng.choice([1, 20])) if rng.random() < 0.5 else None,
            frequency_penalty=float(rng.choice([0.0, 0.3])),
            ignore_eos=True,
        )
        for _ in prompts
    ]
    llm.generate(prompts, params, use_tqdm=False)
    llm.beam_search([prompt(20)], BeamSearchParams(beam_width=4, max_tokens=8))
    stats = llm.get_stats()
    out = {
        "warmup_programs": warm.num_compilations,
        "warmup_compile_s": warm.compile_seconds,
        "engine_build_with_warmup_s": build_s,
        "compiled_by_first_penalties_logprobs_request": after_first,
        "compiled_by_mixed_workload": stats.num_compilations - warm.num_compilations,
        "compile_s_after_warmup": stats.compile_seconds - warm.compile_seconds,
        "preemptions": stats.num_preemptions,
        "swapped_out_blocks": stats.num_swapped_out,
        "load": load(),
    }
    print(json.dumps(out), flush=True)
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], choices=["programs", "generate", "warmup"])
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    print(f"load average at start: {load():.2f}", flush=True)
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="pagedjax-compile-") as tmp:
        tmp = Path(tmp)
        if "generate" not in args.skip:
            report["generate"] = generate_wall(args.model, args.repeats, tmp / "generate")
        # The rest of this process: parameters cached under tmp, compilation cache as below.
        os.environ["PAGEDJAX_CACHE_DIR"] = str(tmp / "inproc")
        if "programs" not in args.skip:
            os.environ["PAGEDJAX_COMPILATION_CACHE"] = "0"  # measure compiling, not loading
            report["step_programs"] = step_programs(args.model, args.repeats)
        if "warmup" not in args.skip:
            report["after_warmup"] = after_warmup(args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
