"""Offline throughput: pagedjax vs Hugging Face transformers on PyTorch, same run, same requests.

    pagedjax bench throughput [--model M] [--num-requests N] [--dataset FILE.json]
        [--max-prompt-len P] [--max-output-len O] [--hf-batch-sizes 8,16,32] [--json]

Both sides get the same prompts (token ids) and output lengths, greedy, EOS ignored so each
request produces exactly its output length. pagedjax runs them through ``LLM.generate`` (continuous
batching over the paged pool). transformers runs its own batched ``generate`` the way vLLM's
``benchmark_throughput --backend hf`` does: requests in order, batches of a fixed size, left
padding, ``max_new_tokens`` = the longest output in the batch (shorter requests' extra tokens are
wasted work, as in any static batch); only requested output tokens are counted. Its batch size
is the best of a small sweep: each size generates one batch of the workload's first requests with
outputs clipped to --hf-sweep-output-len tokens (cheap on a CPU), and the fastest in output
tokens/s runs the whole workload. Each side is warmed once
(pagedjax: the whole workload, so that every bucketed program is compiled; transformers: one small
batch) and the timed figures are the warm runs. On a GPU both sides use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from pagedjax.bench import emit
from pagedjax.bench.workload import sharegpt_like


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


@dataclasses.dataclass
class SideResult:
    name: str
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    batch_size: int | None = None  # transformers: the chosen batch size
    cold_elapsed_s: float | None = None  # first run, compilation included (pagedjax)


def synthetic_requests(
    num_requests: int,
    *,
    vocab_size: int,
    max_prompt_len: int,
    max_output_len: int,
    seed: int = 0,
    low_token: int = 3,
) -> list[Request]:
    """ShareGPT-like lengths clipped to (max_prompt_len, max_output_len); random token ids."""
    lengths = sharegpt_like(num_requests, max_model_len=4096, seed=seed)
    rng = np.random.default_rng(seed + 1)
    return [
        Request(
            rng.integers(low_token, vocab_size, min(r.prompt_len, max_prompt_len)).tolist(),
            min(r.output_len, max_output_len),
        )
        for r in lengths
    ]


def load_dataset(path: str, tokenizer, max_prompt_len: int, max_output_len: int) -> list[Request]:
    """A JSON list of {"prompt": text or token ids, "output_len": int}."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty JSON list of requests")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "prompt" not in item or "output_len" not in item:
            raise ValueError(f"{path}: request {i} needs 'prompt' and 'output_len'")
        prompt = item["prompt"]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"{path}: text prompts need a model with a tokenizer")
            prompt = tokenizer(prompt)["input_ids"]
        if not prompt or int(item["output_len"]) < 1:
            raise ValueError(f"{path}: request {i} has an empty prompt or output_len < 1")
        out.append(
            Request(list(prompt)[:max_prompt_len], min(int(item["output_len"]), max_output_len))
        )
    return out


def _side(name, requests, elapsed, **extra) -> SideResult:
    out_tokens = sum(r.output_len for r in requests)
    all_tokens = out_tokens + sum(len(r.prompt_token_ids) for r in requests)
    return SideResult(
        name, elapsed, len(requests) / elapsed, out_tokens / elapsed, all_tokens / elapsed, **extra
    )


def run_pagedjax(llm, requests: list[Request], warmup: bool = True) -> SideResult:
    from pagedjax import SamplingParams

    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests
    ]
    cold = None
    if warmup:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        cold = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for o, r in zip(outs, requests, strict=True):
        if len(o.outputs[0].token_ids) != r.output_len:
            raise RuntimeError(
                f"pagedjax produced {len(o.outputs[0].token_ids)} tokens, not {r.output_len}"
            )
    return _side("pagedjax", requests, elapsed, cold_elapsed_s=cold)


def _hf_generate(model, batch: list[Request], device) -> None:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding, as decoder-only batched generation needs
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n :] = 1
    new = max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    if out.shape[1] != width + new:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {new}")


def run_hf(model, requests: list[Request], batch_size: int, device) -> SideResult:
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        _hf_generate(model, requests[i : i + batch_size], device)
    return _side("transformers", requests, time.perf_counter() - start, batch_size=batch_size)


def load_hf_model(source: str, device):
    """The same weights in transformers: a .gguf file (dequantized) or an HF checkpoint dir."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(source)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    model.generation_config.eos_token_id = None  # ignore EOS, like the pagedjax side
    return model.to(device).eval()


def benchmark(args) -> dict:
    import jax
    import torch

    from pagedjax import LLM
    from pagedjax.models.loader import default_model_path

    source = args.model or default_model_path()
    on_gpu = jax.devices()[0].platform == "gpu" and torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    max_model_len = args.max_prompt_len + args.max_output_len
    llm = LLM(
        source,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_space_gib=args.kv_cache_space_gib,
        seed=args.seed,
    )
    if args.dataset:
        requests = load_dataset(
            args.dataset, llm.tokenizer, args.max_prompt_len, args.max_output_len
        )
    else:
        requests = synthetic_requests(
            args.num_requests,
            vocab_size=llm.model_config.vocab_size,
            max_prompt_len=args.max_prompt_len,
            max_output_len=args.max_output_len,
            seed=args.seed,
        )
    ours = run_pagedjax(llm, requests, warmup=not args.no_warmup)
    stats = llm.get_stats()
    llm.close()

    hf_sweep, theirs = [], None
    if not args.skip_hf:
        model = load_hf_model(source, device)
        _hf_generate(model, requests[:2], device)  # warm-up
        for bs in args.hf_batch_sizes:
            sample = [
                Request(r.prompt_token_ids, min(r.output_len, args.hf_sweep_output_len))
                for r in requests[:bs]
            ]
            hf_sweep.append(run_hf(model, sample, bs, device))
        best = max(hf_sweep, key=lambda r: r.output_tokens_per_s).batch_size
        theirs = run_hf(model, requests, best, device)
    return {
        "model": source,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "num_requests": len(requests),
        "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in requests])),
        "mean_output_len": float(np.mean([r.output_len for r in requests])),
        "max_prompt_len": args.max_prompt_len,
        "max_output_len": args.max_output_len,
        "pagedjax": dataclasses.asdict(ours),
        "pagedjax_compilations": stats.num_compilations,
        "pagedjax_preemptions": stats.num_preemptions,
        "transformers": dataclasses.asdict(theirs) if theirs else None,
        "hf_sweep_output_len": args.hf_sweep_output_len,
        "transformers_sweep": [dataclasses.asdict(r) for r in hf_sweep],
        "output_tokens_per_s_ratio": (
            ours.output_tokens_per_s / theirs.output_tokens_per_s if theirs else None
        ),
    }


def print_report(res: dict) -> None:
    print(
        f"workload: {res['num_requests']} requests, mean prompt {res['mean_prompt_len']:.1f} "
        f"tokens (clipped to {res['max_prompt_len']}), mean output {res['mean_output_len']:.1f} "
        f"tokens (clipped to {res['max_output_len']}), greedy, EOS ignored"
    )
    print(f"model: {res['model']}  device: {res['device']}  torch threads: {res['torch_threads']}")
    for r in res["transformers_sweep"]:
        print(
            f"  sweep: transformers batch {r['batch_size']:>3} (one batch, outputs <= "
            f"{res['hf_sweep_output_len']}): {r['output_tokens_per_s']:8.1f} output tok/s"
        )
    print(f"{'':28}{'elapsed s':>10}{'requests/s':>12}{'output tok/s':>14}{'total tok/s':>13}")
    rows = [res["pagedjax"]] + ([res["transformers"]] if res["transformers"] else [])
    for r in rows:
        label = r["name"] + (f" (batch {r['batch_size']})" if r["batch_size"] else "")
        print(
            f"{label:28}{r['elapsed_s']:10.2f}{r['requests_per_s']:12.3f}"
            f"{r['output_tokens_per_s']:14.1f}{r['total_tokens_per_s']:13.1f}"
        )
    cold = res["pagedjax"]["cold_elapsed_s"]
    if cold is not None:
        print(
            f"pagedjax first (cold) run, compilation included: {cold:.2f} s "
            f"({res['pagedjax_compilations']} programs compiled)"
        )
    if res["output_tokens_per_s_ratio"] is not None:
        print(
            "ratio pagedjax / transformers, output tokens/s: "
            f"{res['output_tokens_per_s_ratio']:.2f}x"
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
    parser.add_argument("--hf-batch-sizes", type=_batch_sizes, default=[8, 16, 32])
    parser.add_argument("--hf-sweep-output-len", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="pagedjax only")
    parser.add_argument("--no-warmup", action="store_true", help="time pagedjax's first run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


def run(args) -> int:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    res = benchmark(args)
    return emit(res, args.json, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
