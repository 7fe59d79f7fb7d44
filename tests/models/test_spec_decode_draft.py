"""Draft-model speculation on tiny random Llamas: greedy tokens identical to transformers' with a
draft that agrees with the target (the target's own weights: nearly every proposal accepted, also
through preemption by recompute and swap and prefix-cache hits, which shows the draft's pool
follows every block move) and with one that does not (another random model: few accepted)."""

from __future__ import annotations

import pytest
from hf_models import hf_greedy, make_tiny_model, speculation_prompts

from pagedjax import LLM, SamplingParams

BLOCK = 8
MAX_TOKENS = 24
# 12 usable blocks of 8 slots: the 6 sequences (and their lookahead) do not fit at once.
POOL = dict(block_size=BLOCK, max_model_len=64, num_blocks=13, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("draft_target")
    hf = make_tiny_model("llama_gqa", target)
    other = tmp_path_factory.mktemp("draft_other")
    make_tiny_model("llama_gqa", other, seed=1)  # other weights, the same programs
    prompts = speculation_prompts([1, 5, 8, 16, 23], seed=3)
    want = hf_greedy(hf, prompts, MAX_TOKENS)
    return str(target), str(other), prompts, want


def _spec(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


def _greedy():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_targets_own_weights_as_draft_are_accepted(models, mode):
    target, _, prompts, want = models
    llm = LLM(target, speculative_config=_spec(target), preemption_mode=mode, **POOL)
    for _ in range(2):  # the second time the prompts' full blocks are cached
        outs = llm.generate(prompts, _greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert (stats.num_swapped_out > 0) == (mode == "swap")
    spec = stats.spec_decoding
    assert spec.num_draft_tokens > 100 and spec.acceptance_rate > 0.95, spec
    assert stats.num_blocks_used == 0
    llm.close()  # both pools and both models' parameters
    assert llm.runner.draft.params is None and not llm.runner.draft.kv_cache.pages


def test_another_model_as_draft_keeps_the_targets_tokens(models):
    target, other, prompts, want = models
    llm = LLM(target, speculative_config=_spec(other), **POOL)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_stats().spec_decoding.acceptance_rate < 0.5
    # Sampling: reproducible and batch-invariant; the target's own weights accept every
    # proposal (p = q up to rounding, so min(1, p / q) is 1 but for ties of rounding).
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=11, repetition_penalty=1.2)
    alone = llm.generate(prompts[-1], params, use_tqdm=False)[0].outputs[0].token_ids
    together = llm.generate(prompts, params, use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == together and len(alone) == 16
    same = LLM(target, speculative_config=_spec(target), **POOL)
    out = same.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    assert same.get_stats().spec_decoding.acceptance_rate > 0.95


def test_a_draft_with_another_vocabulary_is_refused(models, tmp_path):
    target, _, _, _ = models
    make_tiny_model("llama_gqa", tmp_path, vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target, speculative_config=_spec(str(tmp_path)), **POOL)


@pytest.mark.slow
def test_after_warmup_a_draft_model_compiles_nothing(models):
    target, other, prompts, want = models
    llm = LLM(target, speculative_config=_spec(other), max_num_seqs=4, warmup=True, **POOL)
    warm = llm.get_stats().num_compilations
    sampled = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, logprobs=1)
    penalised = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.2)
    outs = llm.generate(prompts[-4:], [_greedy(), sampled, penalised, _greedy()], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want[-4]
    stats = llm.get_stats()
    assert stats.spec_decoding.num_draft_tokens > 0
    assert stats.num_compilations == warm, "a program compiled after warm-up"
