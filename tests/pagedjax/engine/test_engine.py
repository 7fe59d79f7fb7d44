"""The engine: scheduling, preemption and sharing must not change results (HF is the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import hf_greedy, random_prompts, tiny_llama_hf

from pagedjax import LLM, BeamSearchParams, Logprob, SamplingParams
from pagedjax.engine.llm_engine import LLMEngine

BLOCK = 8
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_hf(tmp_path_factory, "engine_tiny")


@pytest.fixture(scope="module")
def batch16(tiny):
    prompts = random_prompts(16, seed=0)
    return prompts, hf_greedy(tiny[1], prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def shared_prefix(tiny):
    prefix = np.random.default_rng(99).integers(3, 256, 37).tolist()
    prompts = random_prompts(8, seed=5, lo=1, hi=12, prefix=prefix)
    return prompts, hf_greedy(tiny[1], prompts, MAX_TOKENS)


ENGINE_VARIANTS = {
    "roomy": dict(num_blocks=256),
    "recompute_preemption": dict(num_blocks=24, preemption_mode="recompute"),
    "swap_preemption": dict(num_blocks=24, preemption_mode="swap"),
    "auto_preemption": dict(num_blocks=24, preemption_mode="auto"),
    "no_prefix_caching": dict(num_blocks=256, enable_prefix_caching=False),
    "chunked_prefill_forced": dict(num_blocks=256, max_num_batched_tokens=16, max_num_seqs=16),
}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_batch_of_16_matches_hf_greedy(tiny, batch16, variant):
    prompts, expected = batch16
    kwargs = ENGINE_VARIANTS[variant]
    llm = LLM(tiny[0], block_size=BLOCK, max_model_len=128, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats.num_blocks_used == 0
    if "preemption" in variant:
        assert stats.num_preemptions > 0
    if variant == "swap_preemption":
        assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out


@pytest.mark.parametrize("caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_shared_prefix_matches_hf_greedy(tiny, shared_prefix, caching):
    prompts, expected = shared_prefix
    llm = LLM(
        tiny[0], block_size=BLOCK, max_model_len=128, num_blocks=256, enable_prefix_caching=caching
    )
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warms the cache
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    stats = llm.get_stats()
    assert (stats.prefix_cache_hit_rate > 0) == caching
    assert stats.num_blocks_used == 0


def test_seeded_sampling_is_independent_of_batch_and_preemption(tiny):
    path = tiny[0]
    prompts = random_prompts(8, seed=2)
    seeded = SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    others = SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
    llm = LLM(path, block_size=BLOCK, max_model_len=128, num_blocks=256)
    alone = llm.generate(prompts[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts, [seeded] + [others] * 7, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    for mode in ("recompute", "swap"):
        small = LLM(path, block_size=BLOCK, max_model_len=128, num_blocks=24, preemption_mode=mode)
        pre = small.generate(prompts[::-1], [others] * 7 + [seeded], use_tqdm=False)
        assert small.get_stats().num_preemptions > 0
        assert pre[-1].outputs[0].token_ids == alone, mode
    other_seed = SamplingParams(**{**seeded.__dict__, "seed": 99})
    assert llm.generate(prompts[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_parallel_sampling_shares_the_prompt_blocks(tiny):
    prompt = random_prompts(1, seed=7, lo=60, hi=61)[0]
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    shared = LLM(
        tiny[0], block_size=BLOCK, max_model_len=128, num_blocks=256, enable_prefix_caching=False
    )
    out = shared.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the samples diverge
    single = SamplingParams(**{**params.__dict__, "n": 1})
    separate = LLM(
        tiny[0], block_size=BLOCK, max_model_len=128, num_blocks=256, enable_prefix_caching=False
    )
    separate.generate([prompt] * 4, single, use_tqdm=False)
    assert shared.get_stats().num_blocks_peak < separate.get_stats().num_blocks_peak
    assert shared.get_stats().num_blocks_used == separate.get_stats().num_blocks_used == 0
    # Copy-on-write kept every sample's tokens its own: sample 0 matches a lone n=1 request
    # with the same seed.
    assert separate.generate(prompt, single, use_tqdm=False)[0].outputs[0].token_ids == (
        out.outputs[0].token_ids
    )


def test_beam_search_beats_or_ties_greedy(tiny):
    prompts = random_prompts(3, seed=8)
    llm = LLM(tiny[0], block_size=BLOCK, max_model_len=128, num_blocks=256)
    greedy = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    beams = llm.beam_search(
        prompts, BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True, length_penalty=1.0)
    )
    for g, b in zip(greedy, beams, strict=True):
        assert len(b.outputs) == 4
        assert len({tuple(c.token_ids) for c in b.outputs}) == 4  # distinct beams
        assert b.outputs[0].cumulative_logprob >= g.outputs[0].cumulative_logprob - 1e-4
        scores = [c.cumulative_logprob for c in b.outputs]
        assert scores == sorted(scores, reverse=True)
    assert llm.get_stats().num_blocks_used == 0


def test_logprobs_match_hf(tiny):
    path, hf = tiny
    prompt = random_prompts(1, seed=9)[0]
    llm = LLM(path, block_size=BLOCK, max_model_len=128, num_blocks=64)
    out = llm.generate(
        prompt,
        SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    tokens = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0], -1).numpy()
    total = 0.0
    text = llm.get_tokenizer().decode
    for i, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        top = np.argsort(-row)[:3]
        assert list(lps)[0] == tok  # the sampled token first, as vLLM lists them
        assert list(lps)[1:] == top.tolist() or set(lps) >= set(top.tolist())
        for t, lp in lps.items():  # vLLM's Logprob: the value, its rank and its text
            assert isinstance(lp, Logprob)
            assert abs(lp.logprob - row[t]) < 1e-4
            assert lp.rank == 1 + int((row > row[t] + 1e-4).sum())
            assert lp.decoded_token == text([t], skip_special_tokens=False)
        total += row[tok]
    assert abs(out.cumulative_logprob - total) < 1e-3


def test_penalties_follow_their_definition(tiny):
    path, hf = tiny
    prompt = random_prompts(1, seed=10)[0]
    params = SamplingParams(
        max_tokens=10,
        temperature=0,
        ignore_eos=True,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=0.7,
    )
    llm = LLM(path, block_size=BLOCK, max_model_len=128, num_blocks=64)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    tokens = list(prompt)
    for tok in out:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1].numpy().astype(np.float64)
        seen = set(tokens)
        counts = np.bincount(tokens[len(prompt) :], minlength=logits.size)
        for t in seen:
            logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
        logits -= 0.7 * counts + 0.5 * (counts > 0)
        assert tok == int(np.argmax(logits))
        tokens.append(tok)


def test_stop_strings_and_text(tiny):
    llm = LLM(tiny[0], block_size=BLOCK, max_model_len=128, num_blocks=64)
    prompt = "w5 w17 w3 w99"
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    # Incremental detokenisation decodes with a few prompt tokens as context, as vLLM does.
    assert words == llm.tokenizer.decode(free.token_ids).split() and len(words) == MAX_TOKENS
    stop = words[4]
    first = words.index(stop)
    out = llm.generate(
        prompt,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]  # the stop string is not included
    assert out.token_ids == free.token_ids[: first + 1]
    # vLLM's stop_reason: the matched stop string or stop token id; None for a length stop.
    assert out.stop_reason == stop and free.stop_reason is None
    token = free.token_ids[3]
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop_token_ids=[token]
    )
    by_id = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(token) + 1]


def test_randomised_requests_and_aborts_leave_no_blocks(tiny):
    engine = LLM(
        tiny[0],
        block_size=BLOCK,
        max_model_len=96,
        num_blocks=48,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        preemption_mode="auto",
    ).engine
    rng = np.random.default_rng(11)

    def run():
        finished, aborted = 0, 0
        for i in range(200):
            prompt = rng.integers(3, 256, int(rng.integers(1, 60))).tolist()
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 30)),
                ignore_eos=True,
                temperature=float(rng.choice([0.0, 1.0])),
                n=int(rng.choice([1, 1, 1, 2])),
            )
            engine.add_request(f"r{i}", prompt, params)
            if rng.random() < 0.5:
                for out in engine.step():
                    finished += out.finished
            if rng.random() < 0.15:
                victim = f"r{int(rng.integers(0, i + 1))}"
                aborted += victim in engine.requests
                engine.abort_request(victim)
        while engine.has_unfinished_requests():
            for out in engine.step():
                finished += out.finished
        return finished, aborted

    finished, aborted = run()
    assert finished + aborted == 200 and aborted > 0
    stats = engine.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_preemptions > 0
    assert stats.num_compilations <= 24
    rng = np.random.default_rng(11)
    run()
    assert engine.get_stats().num_compilations == stats.num_compilations
    assert engine.get_stats().num_blocks_used == 0


def test_bad_requests_fail_alone(tiny):
    engine: LLMEngine = LLM(tiny[0], block_size=BLOCK, max_model_len=64, num_blocks=64).engine
    for i in range(3):
        engine.add_request(f"good{i}", [5 + i] * (3 + i), GREEDY)
    engine.step()
    bad = [
        ([3] * 64, SamplingParams(), "64 tokens"),
        ([3, 9999], SamplingParams(), "token id 9999"),
        ([3], SamplingParams(n=10, max_tokens=60), "KV blocks at once"),
        ("w3 w4", "nope", "SamplingParams"),
    ]
    for prompt, params, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="good0"):
        engine.add_request("good0", [3], GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(outs) == ["good0", "good1", "good2"]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs.values())
    assert engine.get_stats().num_blocks_used == 0
