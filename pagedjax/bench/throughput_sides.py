"""The sides of ``pagedjax bench throughput``, each run in its own process by the orchestrator
(throughput.py) so that neither side's threads, allocations or compiled programs touch the other:

    python -m pagedjax.bench.throughput_sides prepare|pagedjax|transformers SPEC.json

``prepare`` builds the requests (seeded, or from a dataset), counts their useful FLOPs and
measures the machine's matmul FLOP/s; ``pagedjax`` and ``transformers`` time the workload. Each
writes one JSON object to stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pagedjax.bench.throughput_lora import lora_options, mixed_evenly, random_adapters
from pagedjax.bench.workload import sharegpt_like


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


def synthetic_requests(
    num_requests: int,
    *,
    vocab_size: int,
    max_prompt_len: int,
    max_output_len: int,
    seed: int = 0,
    low_token: int = 3,
    fixed: bool = False,
) -> list[Request]:
    """ShareGPT-like lengths clipped to (max_prompt_len, max_output_len); random token ids.
    ``fixed``: every request exactly (max_prompt_len, max_output_len) (vLLM's --input-len and
    --output-len)."""
    lengths = sharegpt_like(num_requests, max_model_len=4096, seed=seed)
    if fixed:
        lengths = [
            dataclasses.replace(r, prompt_len=max_prompt_len, output_len=max_output_len)
            for r in lengths
        ]
    rng = np.random.default_rng(seed + 1)
    return [
        Request(
            rng.integers(low_token, vocab_size, min(r.prompt_len, max_prompt_len)).tolist(),
            min(r.output_len, max_output_len),
        )
        for r in lengths
    ]


def load_dataset(path: str, tokenizer, max_prompt_len: int, max_output_len: int) -> list[Request]:
    """A JSON list of {"prompt": text or token ids, "output_len": int}, or of ShareGPT's
    conversations (vLLM's dataset: the first turn the prompt, the second's tokens the output)."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty JSON list of requests")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and "conversations" in item and tokenizer is not None:
            turns = item["conversations"]
            if len(turns) < 2:
                continue  # vLLM skips one-turn conversations too
            item = {
                "prompt": turns[0]["value"],
                "output_len": len(tokenizer(turns[1]["value"])["input_ids"]),
            }
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


@dataclasses.dataclass(frozen=True)
class Timed:
    elapsed_s: float
    output_tokens_per_s: float


def generate_pagedjax(llm, requests: list[Request], loras: list | None = None) -> Timed:
    """One ``LLM.generate`` over the requests (greedy, EOS ignored), checked and timed; ``loras``:
    each request's LoRARequest or None."""
    from pagedjax.sampling_params import SamplingParams

    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    for o, r in zip(outs, requests, strict=True):
        if len(o.outputs[0].token_ids) != r.output_len:
            raise RuntimeError(
                f"pagedjax produced {len(o.outputs[0].token_ids)} tokens, not {r.output_len}"
            )
    return Timed(elapsed, sum(r.output_len for r in requests) / elapsed)


def _timings(seconds: list[float]) -> dict:
    return {
        "runs_s": seconds,
        "min_s": min(seconds),
        "median_s": statistics.median(seconds),
    }


# ---- prepare -----------------------------------------------------------------------------------


def prepare(spec: dict) -> dict:
    from pagedjax.bench import roofline
    from pagedjax.models.loader import load_model, load_tokenizer

    loaded = load_model(spec["model"], dtype="float32")
    config = loaded.config
    if spec.get("dataset"):
        tokenizer = load_tokenizer(loaded)
        requests = load_dataset(
            spec["dataset"], tokenizer, spec["max_prompt_len"], spec["max_output_len"]
        )
    else:
        requests = synthetic_requests(
            spec["num_requests"],
            vocab_size=config.vocab_size,
            max_prompt_len=spec["max_prompt_len"],
            max_output_len=spec["max_output_len"],
            seed=spec["seed"],
            fixed=spec.get("fixed_lengths", False),
        )
    if spec.get("output_len"):  # vLLM's --output-len: every request's
        requests = [dataclasses.replace(r, output_len=spec["output_len"]) for r in requests]
    del loaded
    return {
        "requests": [dataclasses.asdict(r) for r in requests],
        "workload_flops": roofline.workload_flops(config, requests),
        "matmul_flops_per_s": roofline.matmul_flops(config, seconds=spec["roofline_seconds"]),
    }


# ---- pagedjax ----------------------------------------------------------------------------------


def run_pagedjax(spec: dict, requests: list[Request]) -> dict:
    t0 = time.perf_counter()
    import jax

    from pagedjax.entrypoints.llm import LLM

    llm = LLM(
        spec["model"],
        dtype="float32",
        block_size=spec["block_size"],
        max_model_len=spec["max_prompt_len"] + spec["max_output_len"],
        max_num_seqs=spec["max_num_seqs"],
        kv_cache_space_gib=spec["kv_cache_space_gib"],
        seed=spec["seed"],
        quantization=spec.get("quantization"),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        async_scheduling=spec.get("async_scheduling", True),
        # Every run repeats the same prompts: with the prefix cache on, the warm runs would skip
        # most of the prefill that the peer (and the cold run) computes.
        enable_prefix_caching=False,
        **lora_options(spec),  # --num-loras: adapters mixed evenly over the requests
    )
    loras = []
    if spec.get("num_loras"):
        directory, rank = tempfile.mkdtemp(prefix="pagedjax-bench-lora-"), spec["max_lora_rank"]
        loras = random_adapters(llm.model_config, spec["num_loras"], rank, directory, spec["seed"])
    loras = mixed_evenly(loras, len(requests))
    load_s = time.perf_counter() - t0
    leaves = jax.tree.leaves(llm.runner.params)
    param_bytes = sum(x.nbytes for x in leaves)
    layers = llm.runner.params["layers"]  # stacked, or one tree per layer (models/layer_loop.py)
    layer = layers[0] if isinstance(layers, (tuple, list)) else layers
    kernel_dtype = str(layer["self_attn"]["q_proj"]["kernel"].dtype)

    def once() -> float:
        return generate_pagedjax(llm, requests, loras).elapsed_s

    cold = once()  # compilation included (fresh process)
    compiled = llm.get_stats().num_compilations
    warm = [once() for _ in range(spec["repeats"])]
    stats = llm.get_stats()
    profile = None
    if spec.get("profile"):  # one more run with the phases timed (slower: no overlap)
        prof = llm.engine.profile
        prof.reset()
        prof.enabled = True
        profiled_s = once()
        prof.enabled = False
        profile = {"elapsed_s": profiled_s, **prof.report()}
    llm.close()
    return {
        "load_s": load_s,
        "quantization": spec.get("quantization"),
        "num_loras": spec.get("num_loras") or 0,
        "param_bytes": param_bytes,
        "kernel_dtype": kernel_dtype,
        "kv_cache_dtype": stats.kv_cache_dtype,
        "num_overlapped_steps": stats.num_overlapped_steps,
        "cold_s": cold,
        "warm": _timings(warm),
        "programs_compiled_cold": compiled,
        "programs_compiled_warm": stats.num_compilations - compiled,
        "compile_seconds": stats.compile_seconds,
        "preemptions": stats.num_preemptions,
        "compilation_cache": os.environ.get("PAGEDJAX_COMPILATION_CACHE", "1"),
        "token_padding_ratio": stats.token_padding_ratio,
        "attention_padding_ratio": stats.attention_padding_ratio,
        "profile": profile,
    }


# ---- transformers ------------------------------------------------------------------------------


def load_hf_model(source: str, device: str):
    """The same weights in transformers: a .gguf file (dequantized) or an HF checkpoint dir."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(source)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # ignore EOS, like the pagedjax side
    return model.to(device).eval()


def hf_generate(model, batch: list[Request], device: str) -> None:
    """One static batch: left padding, max_new_tokens = the batch's longest output (shorter
    requests' extra tokens are wasted work, as in any static batch)."""
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


def hf_batches(requests: list[Request], batch_size: int, sort: bool) -> list[list[Request]]:
    """Static batches in arrival order, or (``sort``) of requests of similar lengths: sorted by
    output then prompt length, which wastes the least padding and the fewest extra tokens."""
    order = list(requests)
    if sort:
        order.sort(key=lambda r: (r.output_len, len(r.prompt_token_ids)))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def generate_hf(model, requests: list[Request], batch_size: int, device: str, sort=True) -> Timed:
    """The requests through transformers in static batches (hf_batches), timed."""
    import torch

    start = time.perf_counter()
    for batch in hf_batches(requests, batch_size, sort):
        hf_generate(model, batch, device)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return Timed(elapsed, sum(r.output_len for r in requests) / elapsed)


def run_transformers(spec: dict, requests: list[Request]) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() and spec.get("device") == "gpu" else "cpu"
    t0 = time.perf_counter()
    model = load_hf_model(spec["model"], device)
    load_s = time.perf_counter() - t0

    def once(batch_size: int, sort: bool) -> float:
        return generate_hf(model, requests, batch_size, device, sort).elapsed_s

    # The process's first pass is its cold run. Then the batch size is chosen on the real
    # workload: one full pass per candidate, length-sorted batches (and arrival order too when
    # asked); the best candidate's pass is its first warm run.
    candidates = [(bs, sort) for sort in spec["hf_sort"] for bs in spec["hf_batch_sizes"]]
    cold = once(*candidates[0])
    sweep = [
        {"batch_size": bs, "sorted": sort, "elapsed_s": once(bs, sort)} for bs, sort in candidates
    ]
    best = min(sweep, key=lambda r: r["elapsed_s"])
    warm = [best["elapsed_s"]]
    warm += [once(best["batch_size"], best["sorted"]) for _ in range(spec["repeats"] - 1)]
    return {
        "load_s": load_s,
        "cold_s": cold,
        "cold_batch": {"batch_size": candidates[0][0], "sorted": candidates[0][1]},
        "warm": _timings(warm),
        "batch_size": best["batch_size"],
        "sorted": best["sorted"],
        "sweep": sweep,
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }


def main(argv: list[str]) -> int:
    side, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    if side == "prepare":
        out = prepare(spec)
    else:
        requests = [Request(**r) for r in spec["requests"]]
        out = (
            run_pagedjax(spec, requests) if side == "pagedjax" else run_transformers(spec, requests)
        )
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
