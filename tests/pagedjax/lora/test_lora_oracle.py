"""LoRA through the engine on real tiny models: requests under three different adapters and the
base model in one batch give, token for token, transformers + PEFT's greedy tokens (each adapter
merged into its own copy of the base), also when the batch is preempted by recompute or swap;
a prefix block is never shared across adapters; more adapters than slots all finish, and
changing adapters compiles nothing after warm-up; speculation keeps an adapter's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hf_models import hf_greedy
from jax.sharding import PartitionSpec as P
from lora_peft import build
from worker_report import run_reporting_worker

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


def test_a_prefix_block_is_never_shared_across_adapters(family):
    """One prompt of three full blocks and a token under adapter 1, then adapter 2, then the base
    model: each gets its own oracle's tokens and no cached block; under adapter 1 again and the
    base again, their own blocks are reused (a shared block would give the next request the
    other adapter's keys and values, and its tokens would leave the oracle's)."""
    base, models, loras = family("llama_gqa")
    llm = lora_llm(base, max_loras=2, num_blocks=64)
    prompt = prompts(1, seed=7, lo=25, hi=26)[0]
    assert len(prompt) == 3 * BLOCK + 1

    def run(slot: int) -> int:
        before = llm.get_stats().prefix_cache_hits
        lora = loras[slot - 1] if slot else None
        out = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == oracle(models, [prompt], [slot])[0], slot
        return llm.get_stats().prefix_cache_hits - before

    assert [run(1), run(2), run(0)] == [0, 0, 0]
    assert [run(1), run(0), run(2)] == [3, 3, 3]


def test_more_adapters_than_slots_finish_with_their_tokens_compiling_nothing(family):
    """Four adapters and the base model over two slots, after warm-up: every request gets its
    oracle's tokens, adapters move in and out of the slots, and nothing compiles."""
    base, models, loras = family("llama_gqa", num_adapters=4)
    llm = lora_llm(base, max_loras=2, max_model_len=32, max_num_seqs=4, warmup=True)
    compiled = llm.get_stats().num_compilations
    batch = prompts(10, seed=3, lo=3, hi=16)
    slots = [i % 5 for i in range(len(batch))]
    requests = [loras[s - 1] if s else None for s in slots]
    outs = llm.generate(batch, GREEDY, lora_request=requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle(models, batch, slots)
    assert llm.engine.lora.manager.num_slot_loads > 2  # adapters changed slots
    assert llm.get_stats().num_compilations == compiled


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_keeps_an_adapters_greedy_tokens(family, method):
    """Speculation with requests under adapters, by prompt lookup or by a draft model (the base
    model, without adapters): the target verifies under each request's adapter, so the tokens
    are the oracle's, as without speculation."""
    base, models, loras = family("llama_gqa")
    motif = prompts(2, seed=11, lo=6, hi=7)
    batch = [m * 4 for m in motif] + [motif[0] * 3]  # repeats, for the lookup to propose
    slots = [1, 2, 0]
    requests = [loras[s - 1] if s else None for s in slots]
    spec = {"method": method, "num_speculative_tokens": 3}
    spec |= (
        {"prompt_lookup_min": 1, "prompt_lookup_max": 4} if method == "ngram" else {"model": base}
    )
    llm = lora_llm(base, max_loras=2, speculative_config=spec)
    outs = llm.generate(batch, GREEDY, lora_request=requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle(models, batch, slots)
    stats = llm.get_stats().spec_decoding
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_tensor_parallel_engine_matches_peft_merged(family):
    """tensor_parallel_size 2 (two virtual CPU devices, in a process of its own): the slots split
    as their base projections are, and the mixed batch's tokens are the oracle's."""
    base, models, loras = family("llama_gqa")
    batch = prompts(4, seed=2, lo=3, hi=20)
    slots = [1, 0, 3, 2]
    worker = Path(__file__).with_name("lora_engine_tp_worker.py")
    paths = ",".join(lora.lora_path for lora in loras)
    argv = [str(worker), base, paths, json.dumps(batch), json.dumps(slots), str(MAX_TOKENS)]
    report = run_reporting_worker(argv, num_devices=2, timeout=600)
    assert report["tokens"] == oracle(models, batch, slots)
    specs = report["specs"]
    assert specs["b/q_proj"] == str(P(None, None, None, "tp")) and specs["a/q_proj"] == str(P())
    assert specs["a/o_proj"] == str(P(None, None, "tp", None)) and specs["b/o_proj"] == str(P())


def test_prompt_logprobs_under_adapters(family):
    """Prompt logprobs of prompts under two adapters and the base model in one batch, in chunks:
    each prompt token's logprob is its adapter's merged model's."""
    import torch

    base, models, loras = family("llama_gqa")
    batch = prompts(3, seed=4, lo=20, hi=30)
    slots = [2, 0, 1]
    llm = lora_llm(base, max_loras=2, max_num_batched_tokens=16, num_blocks=64)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    requests = [loras[s - 1] if s else None for s in slots]
    outs = llm.generate(batch, params, lora_request=requests, use_tqdm=False)
    for out, prompt, slot in zip(outs, batch, slots, strict=True):
        with torch.no_grad():
            logits = models[slot](torch.tensor([prompt])).logits[0].double()
        ref = torch.log_softmax(logits, -1).numpy()
        got = [out.prompt_logprobs[j][t].logprob for j, t in enumerate(prompt) if j]
        want = [ref[j - 1][t] for j, t in enumerate(prompt) if j]
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"slot {slot}")
