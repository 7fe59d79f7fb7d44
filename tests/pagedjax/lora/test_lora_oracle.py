"""LoRA through the engine on real tiny models: requests under three different adapters and the
base model in one batch give, token for token, transformers + PEFT's greedy tokens (each adapter
merged into its own copy of the base), also when the batch is preempted by recompute or swap;
a prefix block is never shared across adapters; more adapters than slots all finish, and
changing adapters compiles nothing after warm-up; speculation keeps an adapter's tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hf_models import hf_greedy
from lora_peft import build

from pagedjax import LLM, SamplingParams

BLOCK = 8
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    built = {}

    def get(name: str, num_adapters: int = 3):
        key = (name, num_adapters)
        if key not in built:
            built[key] = build(name, tmp_path_factory.mktemp(f"lora_{name}"), num_adapters)
        return built[key]

    return get


def prompts(n: int, seed: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def oracle(models, batch, slots) -> list[list[int]]:
    """Each prompt's greedy tokens under its adapter's merged model (slot 0: the base)."""
    return [hf_greedy(models[s], [p], MAX_TOKENS)[0] for p, s in zip(batch, slots, strict=True)]


def lora_llm(base: str, **kwargs) -> LLM:
    options = dict(block_size=BLOCK, max_model_len=128, enable_lora=True, max_lora_rank=16)
    return LLM(base, **(options | kwargs))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "gemma2"])
def test_mixed_adapters_in_one_batch_match_peft_merged_under_preemption(family, name, mode):
    base, models, loras = family(name)
    batch = prompts(12, seed=len(name))
    slots = [i % 4 for i in range(len(batch))]  # adapters 1..3 and the base model, interleaved
    llm = lora_llm(base, max_loras=3, num_blocks=20, preemption_mode=mode)
    requests = [loras[s - 1] if s else None for s in slots]
    outs = llm.generate(batch, GREEDY, lora_request=requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle(models, batch, slots)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert stats.num_blocks_used == 0
