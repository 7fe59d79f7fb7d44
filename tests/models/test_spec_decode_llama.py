"""N-gram speculation on a tiny random Llama: greedy tokens identical to transformers' (the HF
parity prompts, plus a repeat-heavy one) in a pool too small for the batch (preemption by
recompute and by swap), with the prefix cache and chunked prefill on; stops (strings, token ids,
max_tokens) land exactly where they land without speculation; seeded sampling is reproducible
and batch-invariant. Every engine here has the same pool and budget, so they share programs."""

from __future__ import annotations

import numpy as np
import pytest
from hf_models import hf_greedy, make_tiny_model, save_word_tokenizer, speculation_prompts

from pagedjax import LLM, SamplingParams

BLOCK = 8
PROMPT_LENS = [1, 5, 8, 16, 23]  # as tests/models/test_llama_parity.py
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
MAX_TOKENS = 32
# 12 usable blocks of 8 slots: the 6 sequences (and their proposals' lookahead) do not fit.
POOL = dict(block_size=BLOCK, max_model_len=64, num_blocks=13, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_llama_gqa")
    hf = make_tiny_model("llama_gqa", path)
    save_word_tokenizer(path)
    prompts = speculation_prompts(PROMPT_LENS, seed=len("llama_gqa"))
    want = hf_greedy(hf, prompts, MAX_TOKENS)
    return str(path), prompts, want


@pytest.fixture(scope="module")
def spec_llm(tiny):
    return LLM(tiny[0], speculative_config=SPEC, **POOL)


def _greedy(**kw):
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_match_transformers_through_recompute(tiny, spec_llm):
    _, prompts, want = tiny
    outs = spec_llm.generate(prompts, _greedy(), use_tqdm=False)
    assert _tokens(outs) == want
    stats = spec_llm.get_stats()
    spec = stats.spec_decoding
    assert stats.num_preemptions > 0
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert sum(o.spec_decoding.num_drafts for o in outs) == spec.num_drafts
    assert stats.num_blocks_used == 0


def test_swap_and_prefix_cache_keep_greedy_tokens(tiny):
    path, prompts, want = tiny
    llm = LLM(path, preemption_mode="swap", speculative_config=SPEC, **POOL)
    for _ in range(2):  # the second time the prompts' full blocks are cached
        assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == want
    stats = llm.get_stats()
    assert stats.num_swapped_out > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decoding.num_accepted_tokens > 0
    assert stats.num_blocks_used == 0


def test_stops_are_checked_token_by_token(tiny, spec_llm):
    """A stop string, a stop token or max_tokens met inside a run of accepted proposals ends
    the output right there, as without speculation. (The reference engine looks up 32-grams, so
    it never proposes and appends one token a step, through the plain path, while it runs the
    same programs: no second set to compile.)"""
    path, prompts, want = tiny
    never = dict(SPEC, prompt_lookup_min=32, prompt_lookup_max=32)
    plain = LLM(path, speculative_config=never, **POOL)
    params = []
    for ids in want:
        words = plain.tokenizer.decode(ids).split()
        params += [
            _greedy(stop=[" ".join(words[9:11])]),  # a stop string of two words
            _greedy(stop_token_ids=[ids[13]]),
            SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
        ]
    many = [p for p in prompts for _ in range(3)]
    got = spec_llm.generate(many, params, use_tqdm=False)
    ref = plain.generate(many, params, use_tqdm=False)
    for g, w in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert sum(o.outputs[0].finish_reason == "stop" for o in got) >= 2 * len(prompts)
    assert spec_llm.get_stats().spec_decoding.num_accepted_tokens > 0
    assert plain.get_stats().spec_decoding.num_drafts == 0


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny, spec_llm):
    _, prompts, _ = tiny
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=7, logprobs=2)
    alone = spec_llm.generate(prompts[-1], params, use_tqdm=False)[0].outputs[0]
    together = spec_llm.generate(prompts, params, use_tqdm=False)[-1].outputs[0]
    assert alone.token_ids == together.token_ids and len(alone.token_ids) == 24
    for a, t in zip(alone.logprobs, together.logprobs, strict=True):  # programs differ a little
        assert a.keys() == t.keys()
        lps = [[lp.logprob for lp in entry.values()] for entry in (a, t)]
        np.testing.assert_allclose(*lps, atol=1e-4)


@pytest.mark.slow
def test_after_warmup_speculation_compiles_nothing(tiny, spec_llm):
    path, prompts, want = tiny
    llm = LLM(path, speculative_config=SPEC, max_num_seqs=4, warmup=True, **POOL)
    warm = llm.get_stats().num_compilations
    sampled = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=3, logprobs=1)
    params = [_greedy(), sampled, _greedy(repetition_penalty=1.2), _greedy(n=2)]
    outs = llm.generate(prompts[-4:], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want[-4]
    stats = llm.get_stats()
    assert stats.spec_decoding.num_accepted_tokens > 0
    assert stats.num_compilations == warm, "a program compiled after warm-up"


def test_snapshot_and_restore_while_speculating(tiny, spec_llm):
    _, prompts, want = tiny
    engine = spec_llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, _greedy())
    for _ in range(6):
        engine.step()
    assert len(engine.requests) == len(prompts)  # none finished yet
    snap = engine.snapshot()

    def finish():
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        return [outs[f"s{i}"] for i in range(len(prompts))]

    drafts = engine.get_stats().spec_decoding.num_drafts
    assert finish() == want
    engine.restore(snap)
    assert finish() == want
    assert engine.get_stats().spec_decoding.num_drafts > drafts
