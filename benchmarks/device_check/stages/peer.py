"""Stage 5: the stage-3b workload through transformers (PyTorch) on the same device, a batch-size
sweep, its best against pagedjax."""

from __future__ import annotations

import dataclasses

from ..common import (
    TOY_NOTE,
    Budget,
    BudgetSpent,
    Context,
    StageSkipped,
    big_hf_config,
    big_workload,
    say,
)


def run(ctx: Context, budget: Budget, data: dict):
    import torch

    from pagedjax.bench.serve_model import random_llama
    from pagedjax.bench.throughput_sides import Request, generate_hf

    device = ctx.torch_device
    if ctx.platform == "tpu":
        raise StageSkipped("no transformers peer on the same device for a TPU")
    if ctx.platform == "gpu" and device != "cuda":
        raise RuntimeError("torch sees no CUDA device: no peer on the same GPU")
    hf_config = big_hf_config(ctx)
    model = random_llama(hf_config, dtype="bfloat16", device=device)
    requests = big_workload(ctx, hf_config.vocab_size, seed=0)
    # Static batches of similar prompt lengths (the peer's best case).
    requests = sorted(requests, key=lambda r: len(r.prompt_token_ids))
    data["model"] = f"transformers LlamaForCausalLM, {hf_config.num_hidden_layers} layers, bf16"
    data["device"] = device
    generate_hf(model, [Request(requests[0].prompt_token_ids[:16], 4)] * 2, 2, device)  # warm-up
    sweep = data.setdefault("sweep", [])
    for bs in ctx.sizes.hf_batch_sizes:
        if budget.left() <= 0:
            data["partial"] = f"batch sizes run: {[r['batch_size'] for r in sweep]}"
            break
        if device == "cuda":
            torch.cuda.synchronize()
        side = generate_hf(model, requests, bs, device)
        sweep.append({"batch_size": bs, **dataclasses.asdict(side)})
        say(
            f"  transformers batch {bs}: {side.elapsed_s:.1f} s, "
            f"{side.output_tokens_per_s:.0f} output tok/s"
        )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if not sweep:
        budget.check("the first batch size")
    best = max(sweep, key=lambda r: r["output_tokens_per_s"])
    data["best"] = best
    ours = ctx.results.get("engine_8b")
    ours_tps = None
    if ours is not None and "warm" in ours.data:
        ours_tps = ours.data["warm"]["output_tokens_per_s"]
        data["pagedjax_over_transformers"] = ours_tps / best["output_tokens_per_s"]
    summary = (
        f"transformers best batch {best['batch_size']}: {best['output_tokens_per_s']:.0f} out "
        f"tok/s"
        + (
            f"; pagedjax / transformers = {ours_tps / best['output_tokens_per_s']:.2f}x"
            if ours_tps
            else "; no pagedjax figure from stage 3 to compare"
        )
    )
    summary += TOY_NOTE * ctx.interpret
    if "partial" in data:
        raise BudgetSpent(summary)
    return True, summary
