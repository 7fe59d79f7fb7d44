"""Run in a subprocess with 2 virtual CPU devices (XLA_FLAGS set by the caller): the engine with
LoRA under tensor_parallel_size 2, requests under three adapters and the base model in one batch.
Prints a JSON report: each request's tokens, and the partition specs of the runner's slots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from pagedjax import LLM, LoRARequest, SamplingParams  # noqa: E402


def main() -> None:
    base, adapters, prompts, slots = (
        sys.argv[1],
        sys.argv[2].split(","),
        *map(json.loads, sys.argv[3:5]),
    )
    loras = [LoRARequest(f"a{i}", i, d) for i, d in enumerate(adapters, start=1)]
    llm = LLM(
        base,
        tensor_parallel_size=2,
        block_size=8,
        max_model_len=64,
        enable_lora=True,
        max_loras=len(loras),
        max_lora_rank=16,
    )
    params = SamplingParams(max_tokens=int(sys.argv[5]), temperature=0, ignore_eos=True)
    requests = [loras[s - 1] if s else None for s in slots]
    outs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    slots_specs = {
        f"{kind}/{name}": str(x.sharding.spec)
        for kind, tree in (("a", llm.runner.lora.slots.a), ("b", llm.runner.lora.slots.b))
        for name, x in tree.items()
    }
    tokens = [o.outputs[0].token_ids for o in outs]
    print("REPORT " + json.dumps({"tokens": tokens, "specs": slots_specs}))


if __name__ == "__main__":
    main()
