"""Speculation through the real engine over a fake model (tests/support/spec_fake.py): outputs
are identical with and without it over many random workloads (tiny pools that preempt by
recompute or swap, prefix caching, chunked prefill, parallel samples, stop tokens, max_tokens,
the model's length, aborts), the block manager's invariants hold after every step (cached blocks
hold exactly their tokens: no rejected proposal is ever cached) and no block leaks."""

from __future__ import annotations

import numpy as np
import pytest
from spec_fake import run, spec_engine

from pagedjax import SamplingParams
from pagedjax.spec_decode import SpecDecodingStats

MAX_MODEL_LEN = 64


def _workload(seed: int):
    rng = np.random.default_rng(seed)
    roomy = rng.random() < 0.3
    swap = rng.random() < 0.4
    engine_kw = dict(
        model=str(rng.choice(["hash", "induction"])),
        num_blocks=int(rng.integers(40, 64) if roomy else rng.integers(11, 24)),
        num_host_blocks=64 if swap or roomy else 0,
        preemption_mode="swap" if swap else "recompute",
        enable_prefix_caching=bool(rng.random() < 0.7),
        max_num_batched_tokens=int(rng.choice([8, 16, 64])),
        max_num_seqs=int(rng.integers(2, 9)),
        max_model_len=MAX_MODEL_LEN,
    )
    lo = int(rng.integers(1, 3))
    spec = {
        "method": "ngram",
        "num_speculative_tokens": int(rng.integers(1, 6)),
        "prompt_lookup_min": lo,
        "prompt_lookup_max": int(rng.integers(lo, 5)),
    }
    prompts, params = [], []
    shared = rng.integers(3, 32, 12).tolist()  # a prefix some prompts share (prefix caching)
    for _ in range(int(rng.integers(1, 7))):
        kind = rng.choice(["repeat", "random", "shared"])
        if kind == "repeat":
            prompt = rng.integers(3, 32, int(rng.integers(1, 6))).tolist() * int(rng.integers(2, 5))
        elif kind == "random":
            prompt = rng.integers(3, 32, int(rng.integers(1, 24))).tolist()
        else:
            prompt = shared + rng.integers(3, 32, int(rng.integers(0, 6))).tolist()
        sampled = rng.random() < 0.4
        params.append(
            SamplingParams(
                n=2 if roomy and rng.random() < 0.3 else 1,
                max_tokens=int(rng.integers(1, MAX_MODEL_LEN + 8 - len(prompt))),
                temperature=0.8 if sampled else 0.0,
                seed=int(rng.integers(1000)) if sampled else None,
                ignore_eos=bool(rng.random() < 0.7),
                stop_token_ids=rng.integers(3, 32, int(rng.integers(0, 2))).tolist(),
                logprobs=2 if rng.random() < 0.3 else None,
            )
        )
        prompts.append(prompt)
    return engine_kw, spec, prompts, params


def _completions(outputs):
    return {
        r: [(c.token_ids, c.finish_reason, c.cumulative_logprob, c.logprobs) for c in o.outputs]
        for r, o in outputs.items()
    }


@pytest.mark.parametrize("seed", range(48))
def test_outputs_identical_with_and_without_speculation(seed):
    engine_kw, spec, prompts, params = _workload(seed)
    plain_engine = spec_engine(None, **engine_kw)
    plain = run(plain_engine, prompts, params)
    engine = spec_engine(spec, **engine_kw)
    fast = run(engine, prompts, params)
    assert _completions(fast) == _completions(plain)
    generated = sum(len(c.token_ids) for o in plain.values() for c in o.outputs)
    for e in (plain_engine, engine):  # each output token once, through preemption and speculation
        assert e.get_stats().num_generation_tokens == generated
    total = engine.get_stats().spec_decoding
    per_request = [o.spec_decoding for o in fast.values()]
    assert sum(s.num_drafts for s in per_request) == total.num_drafts
    assert sum(s.num_accepted_tokens for s in per_request) == total.num_accepted_tokens
    assert total.num_draft_tokens == engine.runner.num_proposed
    assert 0 <= total.num_accepted_tokens <= total.num_draft_tokens
    for out in fast.values():  # never past max_tokens or the model's length
        for c in out.outputs:
            assert len(c.token_ids) <= params[int(out.request_id[1:])].max_tokens
            assert len(out.prompt_token_ids) + len(c.token_ids) <= MAX_MODEL_LEN


def test_workloads_speculate_and_preempt():
    """The random workloads above do exercise what they claim to."""
    proposed = accepted = preempted = swapped = 0
    for seed in range(48):
        engine_kw, spec, prompts, params = _workload(seed)
        engine = spec_engine(spec, **engine_kw)
        run(engine, prompts, params)
        stats = engine.get_stats()
        proposed += stats.spec_decoding.num_draft_tokens
        accepted += stats.spec_decoding.num_accepted_tokens
        preempted += stats.num_preemptions
        swapped += stats.num_swapped_out
    assert proposed > 500 and accepted > 200 and preempted > 5 and swapped > 5


@pytest.mark.parametrize("seed", range(12))
def test_aborts_mid_speculation_leak_nothing(seed):
    engine_kw, spec, prompts, params = _workload(100 + seed)
    rng = np.random.default_rng(seed)
    abort_at = {
        f"r{i}": int(rng.integers(1, 12)) for i in range(len(prompts)) if rng.random() < 0.5
    }
    run(spec_engine(spec, **engine_kw), prompts, params, abort_at=abort_at)  # checks for leaks


def test_repeats_are_accepted_and_random_text_is_not():
    """A model that continues what repeats accepts nearly every proposal on a repeat-heavy
    prompt; one whose tokens are a hash of the context accepts almost none. Same outputs."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    rates = {}
    for model, prompt in [("induction", [5, 9, 14, 7, 22, 3] * 3), ("hash", list(range(3, 20)))]:
        plain = run(spec_engine(None, model=model), [prompt], [params])["r0"]
        engine = spec_engine(spec, model=model)
        out = run(engine, [prompt], [params])["r0"]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        stats = out.spec_decoding
        assert stats == engine.get_stats().spec_decoding
        rates[model] = stats.acceptance_rate
        if model == "induction":  # steps of up to 5 tokens: far fewer steps than tokens
            assert stats.mean_acceptance_length > 4 and stats.num_drafts <= 10
    assert rates["induction"] > 0.9 and rates["hash"] < 0.2


def test_stats_are_empty_without_speculation():
    out = run(spec_engine(None), [[5, 6, 5, 6]], [SamplingParams(max_tokens=4)])["r0"]
    assert out.spec_decoding is None
    assert SpecDecodingStats().mean_acceptance_length == 0.0
