"""Offline throughput: pagedjax vs Hugging Face transformers on PyTorch, each in its own process.

    pagedjax bench throughput [--model M] [--num-requests N] [--dataset FILE.json]
        [--max-prompt-len P] [--max-output-len O] [--hf-batch-sizes 8,16,32,64]
        [--repeats R] [--quantization Q [--compare-quantization]]
        [--num-loras N [--max-lora-rank R]] [--json]

Both sides get the same prompts (token ids) and output lengths, greedy, EOS ignored so each
request produces exactly its output length. Each side runs in a fresh process of its own, one
after the other (never both at once), so neither disturbs the other:

- prepare: builds the requests, counts their useful FLOPs (every token through the layers once,
  attention over its real context, one LM-head row per output token; bench/roofline.py) and
  measures this machine's matmul FLOP/s at the model's own layer shapes (jax and torch, best of
  repeated runs): the roofline both sides are measured against.
- pagedjax: ``LLM.generate`` over the whole workload (continuous batching over the paged pool),
  prefix caching off (every run repeats the same prompts: the warm runs would otherwise skip the
  prefill the peer computes; the workload shares no prefixes, so nothing real is lost).
  The first call is the cold run (compilation included; the persistent compilation cache is off
  for it unless --keep-compile-cache), then --repeats warm runs.
- transformers: its own batched ``generate``, as vLLM's ``benchmark_throughput --backend hf`` does:
  static batches, left padding, ``max_new_tokens`` = the batch's longest output; only requested
  tokens are counted. Its batch size is chosen on the real workload, not a clipped sample: one
  full pass per candidate size with length-sorted batches (the peer's best case; also arrival
  order with --hf-unsorted too), after a first pass that is its cold run; then --repeats warm runs
  at the best size in all (the sweep's pass included).

With ``--quantization`` (int8, fp8, int8-g64, int8-g32) the pagedjax side loads its weights so
quantized; ``--compare-quantization`` also runs the unquantized pagedjax side first, in a process
of its own, and reports both and their ratio (quantized / unquantized output tok/s).

With ``--num-loras N`` the pagedjax side also runs with N random LoRA adapters (rank
``--max-lora-rank``, every projection targeted; bench/throughput_lora.py) mixed evenly over the
requests, all in one batch (``max_loras`` = N), in a process of its own after the base-only one,
and the report gives its output tok/s as a fraction of the base-only run's.

vLLM's flags are taken with vLLM's meaning: ``--num-prompts``, ``--input-len`` / ``--output-len``
(every request exactly so long, random token ids), ``--dataset-name sharegpt --dataset-path``
(ShareGPT's JSON), ``--backend vllm`` (this engine alone) and ``--output-json`` (vLLM's result:
``elapsed_time`` of the best warm run, ``num_requests``, ``total_num_tokens``,
``requests_per_second``, ``tokens_per_second``).

Reported per side: min and median of the warm runs, the cold run, output tok/s, and the useful
FLOP/s as a fraction of the measured matmul roofline; the ratios warm (min vs min) and cold; and
the share of CPU time a virtual machine's host stole while each process ran (on a shared host,
a figure taken while it was high is slowed by the neighbours, not by the code).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedjax.bench import emit, vllm_result
from pagedjax.bench.throughput_sides import Request, synthetic_requests  # noqa: F401 (re-export)
from pagedjax.models.quant import QUANTIZATIONS


def cpu_ticks() -> tuple[int, int] | None:
    """(ticks stolen by the hypervisor, all ticks) over every CPU since boot, from /proc/stat;
    None where there is none (not Linux)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice: inside user, nice]
    ticks = [int(x) for x in fields[1:9]]
    return (ticks[7], sum(ticks)) if fields[0] == "cpu" and len(ticks) == 8 else None


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time the hypervisor gave to other guests between two cpu_ticks()."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _run_side(side: str, spec: dict, env: dict | None = None) -> dict:
    """One side in a fresh process; its JSON result, with ``cpu_steal_share`` (a shared VM's
    stolen time while the side ran: a busy host slows whichever side it hits)."""
    start = cpu_ticks()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "pagedjax.bench.throughput_sides", side, str(path)],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
        )
    if proc.returncode != 0:
        raise RuntimeError(f"the {side} side failed:\n{proc.stderr[-4000:]}")
    return {
        **json.loads(proc.stdout.strip().splitlines()[-1]),
        "cpu_steal_share": steal_share(start, cpu_ticks()),
    }


def _rates(side: dict, out_tokens: int, flops: float, roof: float) -> dict:
    best, cold = side["warm"]["min_s"], side["cold_s"]
    return {
        "output_tokens_per_s": out_tokens / best,
        "output_tokens_per_s_median": out_tokens / side["warm"]["median_s"],
        "cold_output_tokens_per_s": out_tokens / cold,
        "useful_flops_per_s": flops / best,
        "roofline_fraction": flops / best / roof,
        "cold_roofline_fraction": flops / cold / roof,
    }


def benchmark(args) -> dict:
    from pagedjax.models.loader import default_model_path

    spec = {
        "model": args.model or default_model_path(),
        "dataset": args.dataset,
        "num_requests": args.num_requests,
        "max_prompt_len": args.max_prompt_len,
        "max_output_len": args.max_output_len,
        "seed": args.seed,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_space_gib": args.kv_cache_space_gib,
        "repeats": args.repeats,
        "roofline_seconds": args.roofline_seconds,
        "hf_batch_sizes": args.hf_batch_sizes,
        "hf_sort": [True, False] if args.hf_unsorted else [True],
        "device": args.device,
        "profile": args.profile,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "async_scheduling": args.async_scheduling,
        "fixed_lengths": args.input_len is not None,  # vLLM's --input-len / --output-len
        "output_len": args.output_len,
    }
    prep = _run_side("prepare", spec)
    requests = [Request(**r) for r in prep["requests"]]
    spec["requests"] = prep["requests"]
    roof = max(prep["matmul_flops_per_s"].values())
    out_tokens = sum(r.output_len for r in requests)
    flops = prep["workload_flops"]
    cache_env = {} if args.keep_compile_cache else {"PAGEDJAX_COMPILATION_CACHE": "0"}
    unquantized = None
    if args.compare_quantization:  # the float weights first, in their own process
        unquantized = _run_side("pagedjax", {**spec, "quantization": None}, cache_env)
        unquantized.update(_rates(unquantized, out_tokens, flops, roof))
    ours = _run_side("pagedjax", spec, cache_env)
    ours.update(_rates(ours, out_tokens, flops, roof))
    lora = None
    if args.num_loras:  # the same workload with adapters mixed evenly, after the base-only run
        lora_spec = {**spec, "num_loras": args.num_loras, "max_lora_rank": args.max_lora_rank}
        lora = _run_side("pagedjax", lora_spec, cache_env)
        lora.update(_rates(lora, out_tokens, flops, roof))
    theirs = None
    if not args.skip_hf:
        theirs = _run_side("transformers", spec)
        theirs.update(_rates(theirs, out_tokens, flops, roof))
    ratio = (lambda k: ours[k] / theirs[k]) if theirs else (lambda k: None)
    q_ratio = (lambda k: ours[k] / unquantized[k]) if unquantized else (lambda k: None)
    return {
        "model": spec["model"],
        "num_requests": len(requests),
        "mean_prompt_len": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "mean_output_len": out_tokens / len(requests),
        "max_prompt_len": args.max_prompt_len,
        "max_output_len": args.max_output_len,
        "output_tokens": out_tokens,
        "workload_gflop": flops / 1e9,
        "matmul_gflops_per_s": {k: v / 1e9 for k, v in prep["matmul_flops_per_s"].items()},
        "prepare_cpu_steal_share": prep.get("cpu_steal_share"),
        "repeats": args.repeats,
        "pagedjax": ours,
        "transformers": theirs,
        "warm_ratio": ratio("output_tokens_per_s"),
        "cold_ratio": ratio("cold_output_tokens_per_s"),
        "quantization": args.quantization,
        "pagedjax_unquantized": unquantized,  # with --compare-quantization
        "quantization_warm_ratio": q_ratio("output_tokens_per_s"),  # quantized / unquantized
        "quantization_cold_ratio": q_ratio("cold_output_tokens_per_s"),
        "pagedjax_lora": lora,  # with --num-loras
        "lora_warm_ratio": lora and lora["output_tokens_per_s"] / ours["output_tokens_per_s"],
        "lora_cold_ratio": lora
        and lora["cold_output_tokens_per_s"] / ours["cold_output_tokens_per_s"],
    }


def print_report(res: dict) -> None:
    print(
        f"workload: {res['num_requests']} requests, mean prompt {res['mean_prompt_len']:.1f} "
        f"tokens (clipped to {res['max_prompt_len']}), mean output {res['mean_output_len']:.1f} "
        f"tokens (clipped to {res['max_output_len']}), greedy, EOS ignored; "
        f"{res['workload_gflop']:.0f} GFLOP of useful work"
    )
    roof = ", ".join(f"{k} {v:.1f}" for k, v in res["matmul_gflops_per_s"].items())
    print(f"model: {res['model']}\nmatmul roofline at the model's shapes (GFLOP/s): {roof}")
    theirs = res["transformers"]
    for r in theirs["sweep"] if theirs else ():
        order = "length-sorted" if r["sorted"] else "arrival order"
        print(
            f"  sweep: transformers batch {r['batch_size']:>3} ({order}, whole workload): "
            f"{r['elapsed_s']:8.2f} s"
        )
    print(
        f"{'':30}{'warm min s':>11}{'median s':>10}{'out tok/s':>11}{'of roof':>9}"
        f"{'cold s':>9}{'cold tok/s':>12}"
    )
    q = res.get("quantization")
    sides = [(f"pagedjax ({q})" if q else "pagedjax", res["pagedjax"])]
    if res.get("pagedjax_unquantized"):
        sides.insert(0, ("pagedjax (unquantized)", res["pagedjax_unquantized"]))
    if res.get("pagedjax_lora"):
        sides.append(
            (f"pagedjax ({res['pagedjax_lora']['num_loras']} LoRAs)", res["pagedjax_lora"])
        )
    if theirs:
        order = "sorted" if theirs["sorted"] else "unsorted"
        sides.append((f"transformers (batch {theirs['batch_size']}, {order})", theirs))
    for label, r in sides:
        print(
            f"{label:30}{r['warm']['min_s']:11.2f}{r['warm']['median_s']:10.2f}"
            f"{r['output_tokens_per_s']:11.1f}{r['roofline_fraction']:9.2f}"
            f"{r['cold_s']:9.2f}{r['cold_output_tokens_per_s']:12.1f}"
        )
    for label, r in sides:
        if "param_bytes" in r:  # the pagedjax sides
            mib = r["param_bytes"] / 2**20
            print(
                f"{label} parameters: {mib:.1f} MiB, kernels {r['kernel_dtype']}; KV pool "
                f"{r.get('kv_cache_dtype')}; {r.get('num_overlapped_steps')} steps overlapped"
            )
    stolen = [("roofline", res.get("prepare_cpu_steal_share"))]
    stolen += [(label.split(" (")[0], r.get("cpu_steal_share")) for label, r in sides]
    if all(share is not None for _, share in stolen):
        print(
            "CPU time stolen by the hypervisor while each ran (/proc/stat): "
            + ", ".join(f"{label} {share:.1%}" for label, share in stolen)
        )
    p = res["pagedjax"]
    print(
        f"pagedjax cold run: {p['programs_compiled_cold']} programs compiled "
        f"(compilation cache {'on' if p['compilation_cache'] != '0' else 'off'}), "
        f"{p['programs_compiled_warm']} while warm; model load {p['load_s']:.1f} s"
    )
    if p.get("profile"):
        print_profile(p["profile"])
    if res.get("quantization_warm_ratio") is not None:
        print(
            f"ratio pagedjax {q} / unquantized, output tok/s: warm "
            f"{res['quantization_warm_ratio']:.2f}x, cold {res['quantization_cold_ratio']:.2f}x"
        )
    if res.get("lora_warm_ratio") is not None:
        print(
            f"ratio pagedjax with LoRAs / base only, output tok/s: warm "
            f"{res['lora_warm_ratio']:.2f}x, cold {res['lora_cold_ratio']:.2f}x"
        )
    if res["warm_ratio"] is not None:
        print(
            f"ratio pagedjax / transformers, output tok/s: warm {res['warm_ratio']:.2f}x, "
            f"cold {res['cold_ratio']:.2f}x"
        )


def print_profile(prof: dict) -> None:
    print(f"profiled run (phases timed, so no host/device overlap): {prof['elapsed_s']:.2f} s")
    shares = prof["phases_share"]
    print("  " + "  ".join(f"{k} {v:.0%} ({prof['phases_s'][k]:.2f} s)" for k, v in shares.items()))
    head = [("steps", 7), ("device s", 10), ("ms/step", 9), ("real tok", 10)]
    head += [("padded tok", 12), ("tok pad", 9), ("attn pad", 10)]
    print(f"  {'step kind':10}" + "".join(f"{name:>{w}}" for name, w in head))
    for kind, k in prof["kinds"].items():
        print(
            f"  {kind:10}{k['steps']:7d}{k['device_seconds']:10.2f}"
            f"{1e3 * k['device_seconds'] / max(k['steps'], 1):9.1f}"
            f"{k['real_tokens']:10d}{k['padded_tokens']:12d}"
            f"{k['padded_tokens'] / max(k['real_tokens'], 1):9.2f}"
            f"{k['padded_attention'] / max(k['real_attention'], 1):10.2f}"
        )


def _batch_sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="pagedjax bench throughput")
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--dataset", default=None, help='JSON: [{"prompt": ..., "output_len": N}]')
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--max-output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-space-gib", type=float, default=None)
    parser.add_argument("--hf-batch-sizes", type=_batch_sizes, default=[8, 16, 32, 64])
    parser.add_argument(
        "--hf-unsorted", action="store_true", help="also try arrival-order batches for the peer"
    )
    parser.add_argument("--repeats", type=int, default=3, help="warm runs per side (min, median)")
    parser.add_argument("--roofline-seconds", type=float, default=2.0)
    parser.add_argument(
        "--keep-compile-cache",
        action="store_true",
        help="let pagedjax's cold run load programs from the persistent compilation cache",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"], help="for the peer")
    parser.add_argument("--skip-hf", action="store_true", help="pagedjax only")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more pagedjax run with its wall time split by phase and padding per step kind",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="weight-only quantization of the pagedjax side's linear layers",
    )
    parser.add_argument(
        "--compare-quantization",
        action="store_true",
        help="also run the unquantized pagedjax side (its own process) and report the ratio",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "int8", "fp8"),
        help="the pagedjax side's KV pool (auto: the compute dtype)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the pagedjax side's host/device overlap (--no-async-scheduling: synchronous steps)",
    )
    parser.add_argument(
        "--num-loras",
        type=int,
        default=0,
        help="also run the pagedjax side with this many random LoRA adapters, mixed evenly",
    )
    parser.add_argument("--max-lora-rank", type=int, default=8, help="their rank (--num-loras)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    _add_vllm_args(parser)
    return parser


def _add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """`vllm bench throughput`'s flags, in terms of this benchmark's."""
    v = parser.add_argument_group("vLLM's flags")
    v.add_argument(
        "--backend",
        default=None,
        choices=("pagedjax", "vllm", "hf"),
        help="pagedjax / vllm: this engine alone (as --skip-hf); hf: with transformers beside "
        "it (the default)",
    )
    v.add_argument("--num-prompts", type=int, default=None, help="as --num-requests")
    v.add_argument(
        "--input-len", type=int, default=None, help="every prompt this long (random token ids)"
    )
    v.add_argument("--output-len", type=int, default=None, help="every request's output length")
    v.add_argument("--dataset-name", default=None, choices=("random", "sharegpt", "json"))
    v.add_argument(
        "--dataset-path", default=None, help="ShareGPT's JSON (sharegpt), or ours (json)"
    )
    v.add_argument("--output-json", default=None, help="write vLLM's result JSON here")


def _resolve_vllm_args(args) -> None:
    if args.num_prompts is not None:
        args.num_requests = args.num_prompts
    if args.backend in ("pagedjax", "vllm"):
        args.skip_hf = True
    if args.dataset_name in ("sharegpt", "json"):
        if not args.dataset_path:
            raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
        args.dataset = args.dataset_path
    elif args.dataset_path:
        raise ValueError("--dataset-path needs --dataset-name sharegpt or json")
    if args.input_len is not None:
        if args.dataset:
            raise ValueError("--input-len is for the random dataset (no --dataset)")
        args.max_prompt_len = args.input_len
        if args.output_len is None:
            raise ValueError("--input-len needs --output-len (vLLM's random dataset)")
    if args.output_len is not None:
        if args.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
        args.max_output_len = args.output_len


def vllm_json(res: dict) -> dict:
    """vLLM's throughput result of ours: the pagedjax side's best warm run (with ours beside)."""
    ours = res["pagedjax"]
    prompt_tokens = round(res["mean_prompt_len"] * res["num_requests"])
    total = prompt_tokens + res["output_tokens"]
    out = vllm_result.throughput_result(ours["warm"]["min_s"], res["num_requests"], total)
    out.update(
        total_num_prompt_tokens=prompt_tokens,
        total_num_output_tokens=res["output_tokens"],
        output_tokens_per_second=res["output_tokens"] / ours["warm"]["min_s"],
        cold_elapsed_time=ours["cold_s"],
        model=res["model"],
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


def run(args) -> int:
    _resolve_vllm_args(args)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_loras < 0 or args.max_lora_rank < 1:
        raise ValueError(
            f"--num-loras must be >= 0 and --max-lora-rank >= 1, got {args.num_loras} and "
            f"{args.max_lora_rank}"
        )
    if args.compare_quantization and args.quantization is None:
        raise ValueError("--compare-quantization needs --quantization (what to compare with)")
    res = benchmark(args)
    if args.output_json:
        vllm_result.write_json(args.output_json, vllm_json(res))
    return emit(res, args.json, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
