"""The rejection sampler as a pure function: every emitted token is distributed as the target's
distribution (chi-square over many rows), whatever the proposal; greedy rows accept exactly the
argmax; rows without a proposal are the plain sampler's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from pagedjax.worker.rejection import rejection_sample
from pagedjax.worker.sampler import SamplingInput, SamplingRow, sample

VOCAB = 6
TARGET = np.log(np.array([0.32, 0.24, 0.18, 0.12, 0.09, 0.05], np.float32))
N = 20_000  # rows: every test here uses this one shape (one program per variant to compile)
_verify = jax.jit(rejection_sample)


def _sampling(n: int, first: int = 0, **row) -> SamplingInput:
    """Rows first .. first + n - 1, each with its own seed and position."""
    ids = range(first, first + n)
    rows = [SamplingRow(seed=i * 7919 % 2**32, position=100 + i % 13, **row) for i in ids]
    return SamplingInput.build(rows, n, VOCAB)


def _expected(temperature: float, top_k: int = 0) -> np.ndarray:
    x = TARGET / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    p = np.exp(x - x.max()).astype(np.float64)
    return p / p.sum()


def _chi_square_p(tokens: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=VOCAB)
    support = p > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the target's support: {counts}"
    expected = N * p[support].astype(np.float64) / p[support].sum(dtype=np.float64)
    return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
@pytest.mark.parametrize("proposal", ["one-hot likely", "one-hot unlikely", "draft distribution"])
def test_emitted_tokens_follow_the_target(temperature, top_k, proposal):
    rng = np.random.default_rng(0)
    logits = np.tile(TARGET, (N, 1))
    q = None
    if proposal == "one-hot likely":
        drafts = np.zeros(N, np.int32)
    elif proposal == "one-hot unlikely":
        drafts = np.full(N, VOCAB - 1, np.int32)  # outside the top-k when top_k=4
    else:  # a deliberately different draft model: q favours the target's least likely tokens
        q1 = np.array([0.05, 0.05, 0.1, 0.2, 0.25, 0.35], np.float32)
        q = np.tile(q1, (N, 1))
        drafts = rng.choice(VOCAB, N, p=q1).astype(np.int32)
    out = _verify(logits, _sampling(N, temperature=temperature, top_k=top_k), drafts, q)
    tokens, accepted = np.asarray(out.tokens), np.asarray(out.accepted)
    p = _expected(temperature, top_k)
    assert _chi_square_p(tokens, p) > 1e-3
    assert (tokens[accepted] == drafts[accepted]).all()
    assert (tokens[~accepted] != drafts[~accepted]).all() or q is not None
    if q is None:  # one-hot q: accepted with probability p(draft)
        rate = accepted.mean()
        assert abs(rate - p[drafts[0]]) < 4 * np.sqrt(p[drafts[0]] * (1 - p[drafts[0]]) / N) + 1e-9
    else:
        want = np.minimum(1.0, p / q[0])  # acceptance probability per draft token
        assert abs(accepted.mean() - (q[0] * want).sum()) < 0.01


def test_greedy_rows_accept_the_argmax_only():
    n = N
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(n, VOCAB)).astype(np.float32)
    drafts = rng.integers(-1, VOCAB, n).astype(np.int32)
    out = _verify(logits, _sampling(n, temperature=0.0), drafts)
    argmax = logits.argmax(-1)
    np.testing.assert_array_equal(np.asarray(out.tokens), argmax)
    np.testing.assert_array_equal(np.asarray(out.accepted), (drafts >= 0) & (drafts == argmax))


def test_rows_without_a_proposal_are_the_samplers():
    n = N
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(n, VOCAB)).astype(np.float32)
    sampling = _sampling(n, temperature=0.9, top_p=0.8)
    out = _verify(logits, sampling, np.full(n, -1, np.int32))
    ref = jax.jit(sample)(logits, sampling)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(ref.logprobs))
    assert not np.asarray(out.accepted).any()


def test_same_seed_and_position_same_result_whatever_the_batch():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2 * N, VOCAB)).astype(np.float32)
    drafts = rng.integers(0, VOCAB, 2 * N).astype(np.int32)
    sampling = _sampling(N, first=N // 2, temperature=1.0)
    rows = slice(N // 2, N // 2 + N)  # the same rows in another batch: other rows around them
    alone = _verify(logits[rows], sampling, drafts[rows])
    shifted = np.roll(np.arange(N), 7)  # and in another order
    moved = _verify(logits[rows][shifted], _sampling_of(sampling, shifted), drafts[rows][shifted])
    np.testing.assert_array_equal(np.asarray(alone.tokens)[shifted], np.asarray(moved.tokens))
    np.testing.assert_array_equal(np.asarray(alone.accepted)[shifted], np.asarray(moved.accepted))


def _sampling_of(s: SamplingInput, order: np.ndarray) -> SamplingInput:
    """The rows of ``s`` in another order."""
    return jax.tree.map(lambda x: np.asarray(x)[order] if np.ndim(x) else x, s)
