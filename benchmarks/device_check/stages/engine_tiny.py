"""Stage 3a: a tiny random Llama through ``LLM.generate``, greedy tokens equal to transformers',
through preemption (recompute, then swap) and prefix caching."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import numpy as np

from ..common import Budget, Context, say


def tiny_hf_model(directory: Path, device: str):
    """A tiny random Llama (GQA), saved with save_pretrained; returns the torch model."""
    from pagedjax.bench.tiny import tiny_llama

    model = tiny_llama(directory)
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos does
    return model.to(device)


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    import torch

    outs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding in the oracle
            ids = torch.tensor([p], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(ctx: Context, budget: Budget, data: dict):
    import torch

    from pagedjax import LLM, SamplingParams

    device = ctx.torch_device
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle in true float32
    new = ctx.sizes.tiny_new_tokens
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 256, 32).tolist()  # two full blocks shared by every prompt
    prompts = [prefix + rng.integers(3, 256, n).tolist() for n in (3, 9, 17, 1, 12, 25)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        hf = tiny_hf_model(model_dir, device)
        expected = hf_greedy(hf, prompts, new, device)
        del hf
        data["oracle"] = f"transformers {device} float32, one prompt at a time"
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        runs = []
        # Pool of 11 usable blocks for 6 sequences of up to 5 blocks: preemption must happen.
        for mode in ctx.sizes.tiny_preemption_modes:
            # XLA on a GPU may use TF32 for float32 matmuls; the comparison wants float32.
            with jax.default_matmul_precision("highest"):
                llm = LLM(
                    str(model_dir),
                    dtype="float32",
                    block_size=16,
                    num_blocks=12,
                    max_model_len=96,
                    max_num_seqs=8,
                    enable_prefix_caching=True,
                    preemption_mode=mode,
                    swap_space_gib=0.01,
                    cache_dir=str(Path(tmp) / "cache"),
                )
                try:
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    stats = llm.get_stats()
                finally:
                    llm.close()
            got = [list(o.outputs[0].token_ids) for o in outs]
            diffs = [first_difference(g, e) for g, e in zip(got, expected, strict=True)]
            run = dict(
                preemption_mode=mode,
                equal=sum(d is None for d in diffs),
                prompts=len(prompts),
                first_difference=diffs,
                num_preemptions=stats.num_preemptions,
                num_swapped_out=stats.num_swapped_out,
                prefix_cache_hits=stats.prefix_cache_hits,
                prefix_cache_queries=stats.prefix_cache_queries,
                num_compilations=stats.num_compilations,
            )
            run["ok"] = bool(
                run["equal"] == len(prompts)
                and stats.num_preemptions > 0
                and stats.prefix_cache_hits > 0
                and (mode != "swap" or stats.num_swapped_out > 0)
            )
            runs.append(run)
            say(f"  tiny Llama, preemption={mode}: {run}")
    data["runs"] = runs
    ok = all(r["ok"] for r in runs)
    summary = "tiny: " + ", ".join(
        f"{r['preemption_mode']} {r['equal']}/{r['prompts']} = HF ({r['num_preemptions']} "
        f"preempted, {r['prefix_cache_hits']} prefix hits)"
        for r in runs
    )
    return ok, summary
