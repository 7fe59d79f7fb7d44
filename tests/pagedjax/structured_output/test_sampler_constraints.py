"""Logit bias and allowed-token bitmasks in the on-device sampler: fixed-width inputs (no program
per request), applied before penalties and filters, raw logprobs unchanged."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pagedjax.sampling_params import MAX_LOGIT_BIAS
from pagedjax.worker.sampler import SamplingInput, SamplingRow, bitmask_width, sample

V = 100
_sample = jax.jit(sample)


def mask_of(allowed, vocab=V) -> np.ndarray:
    words = np.zeros(bitmask_width(vocab), np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


def run(logits, rows, size=4):
    s = SamplingInput.build(rows, size, V, history_width=16)
    return jax.tree.map(np.asarray, _sample(logits, s))


def test_widths_are_fixed_and_zero_when_unused():
    plain = SamplingInput.build([SamplingRow()], 4, V)
    assert plain.bias_ids.shape == (4, 0) and plain.token_bitmask.shape == (4, 0)
    biased = SamplingInput.build([SamplingRow(logit_bias=((5, 1.0),))], 4, V)
    masked = SamplingInput.build([SamplingRow(token_bitmask=mask_of([1]))], 4, V)
    for s in (biased, masked):
        assert s.bias_ids.shape == (4, MAX_LOGIT_BIAS)
        assert s.token_bitmask.shape == (4, bitmask_width(V))
    # Rows without a bias or mask are no-ops: padding ids fall outside, masks allow all.
    assert (biased.token_bitmask == -1).all() and (masked.bias_ids == V).all()


def test_logit_bias_forces_and_forbids_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    rows = [
        SamplingRow(logit_bias=((17, 100.0),)),  # greedy: forced
        SamplingRow(temperature=1.0, seed=3, logit_bias=((42, 100.0),)),  # sampled: forced
        SamplingRow(logit_bias=((int(logits[2].argmax()), -100.0),)),  # the argmax forbidden
        SamplingRow(),
    ]
    out = run(logits, rows)
    assert out.tokens[0] == 17 and out.tokens[1] == 42
    assert out.tokens[2] == np.argsort(-logits[2])[1]
    assert out.tokens[3] == logits[3].argmax()
    # Logprobs stay the raw model's.
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(4), out.tokens], atol=1e-5)


def test_bitmask_restricts_greedy_and_sampled_rows():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    allowed = [3, 31, 32, 64, 99]  # word edges and the last (partial) word
    mask = mask_of(allowed)
    seen = set()
    for seed in range(40):
        rows = [
            SamplingRow(token_bitmask=mask),
            SamplingRow(temperature=2.0, seed=seed, token_bitmask=mask),
            SamplingRow(temperature=1.0, top_k=2, seed=seed, token_bitmask=mask),
            SamplingRow(temperature=1.0, seed=seed),
        ]
        out = run(logits, rows)
        assert out.tokens[0] == max(allowed, key=lambda t: logits[0, t])
        assert out.tokens[1] in allowed and out.tokens[2] in allowed
        top2 = sorted(allowed, key=lambda t: -logits[2, t])[:2]
        assert out.tokens[2] in top2
        seen.add(int(out.tokens[1]))
    assert len(seen) >= 3  # it still samples among the allowed


def test_bad_constraints_are_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingInput.build([SamplingRow(logit_bias=((V, 1.0),))], 2, V)
    too_many = tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))
    with pytest.raises(ValueError, match="logit biases"):
        SamplingInput.build([SamplingRow(logit_bias=too_many)], 2, V)
