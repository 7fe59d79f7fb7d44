"""The sampler against a float64 numpy reference written the way vLLM writes it (penalties, then
temperature, then min-p, top-k and top-p masks each on what the last left), plus seeds and logprobs.

Shapes are few and reused (one jitted function, compiled once per shape). The vocabulary (1000) is
wider than the sampler's top-k candidates (256), so both the candidate path and the full-sort
fallback run.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pagedjax.worker import sampler
from pagedjax.worker.sampler import TOP_LOGPROBS_WIDTH, SamplerOutput, SamplingInput, SamplingRow

V = 1000
S = 8

HISTORY = 64  # token-history width when some row uses penalties (no row here holds more)
DELTA = 1e-4  # slack on top_p / min_p for tokens on the float32 edge of a filter

assert V > sampler._NUM_CANDIDATES


@jax.jit
def _run(logits, s):
    return sampler.sample(logits, s), sampler.process_logits(logits, s)


def run(logits, rows, size=S, vocab=V):
    s = SamplingInput.build(rows, size, vocab, history_width=HISTORY)
    out, processed = _run(np.asarray(logits, np.float32), s)
    return jax.tree.map(np.asarray, out), np.asarray(processed), s


# ---- the reference ----------------------------------------------------------------------------


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def ref_penalise(logits, r: SamplingRow):
    x = np.asarray(logits, np.float64).copy()
    counts = np.bincount(np.asarray(r.output_token_ids, int), minlength=len(x))
    seen = counts > 0
    seen[np.asarray(r.prompt_token_ids, int)] = True
    p = r.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / p, x[seen] * p)
    return x - r.frequency_penalty * counts - r.presence_penalty * (counts > 0)


def ref_filter(x, top_k, top_p, min_p):
    x = x.copy()
    probs = softmax(x)
    x[probs < min_p * probs.max()] = -np.inf
    if 0 < top_k < len(x):
        x[x < np.sort(x)[::-1][top_k - 1]] = -np.inf
    if top_p < 1:
        order = np.argsort(x, kind="stable")  # ascending, as vLLM
        cum = np.cumsum(softmax(x[order]))
        drop = cum <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    return x


def ref_process(logits, r: SamplingRow, slack=0.0):
    """Penalised, scaled, filtered logits; slack > 0 loosens top-p / min-p, < 0 tightens them."""
    x = ref_penalise(logits, r)
    if r.temperature > 0:
        x = x / r.temperature
    top_p = min(r.top_p + slack, 1.0) if r.top_p < 1 else 1.0
    return ref_filter(x, r.top_k, top_p, r.min_p * (1 - slack))


def check_processed(got, logits, r: SamplingRow):
    """The kept set lies between the tightened and loosened reference sets; kept values match."""
    inner = np.isfinite(ref_process(logits, r, -DELTA))
    outer = ref_process(logits, r, DELTA)
    kept = np.isfinite(got)
    assert kept.any()
    assert np.all(kept[inner]), "a token the reference keeps was filtered"
    assert not np.any(kept & ~np.isfinite(outer)), "a token the reference filters was kept"
    np.testing.assert_allclose(got[kept], outer[kept], rtol=1e-5, atol=1e-5)


def random_row(rng, seed=None, penalties=None) -> SamplingRow:
    c = lambda *xs: xs[rng.integers(len(xs))]
    if penalties is None:
        penalties = rng.random() < 0.5
    kw = {}
    if penalties:
        kw = dict(
            presence_penalty=c(0.0, 0.5, -0.3),
            frequency_penalty=c(0.0, 0.4, 1.1),
            repetition_penalty=c(1.0, 1.3, 0.8),
            # Small id ranges overlap: tokens in the prompt only, the output only, and both.
            prompt_token_ids=rng.integers(0, 40, rng.integers(0, 17)).tolist(),
            output_token_ids=rng.integers(20, 60, rng.integers(0, 17)).tolist(),
        )
    return SamplingRow(
        temperature=c(0.0, 0.5, 1.0, 1.7),
        top_k=c(0, 0, 1, 7, 100, 300, 700, V + 5),
        top_p=c(1.0, 1.0, 0.3, 0.8, 0.95),
        min_p=c(0.0, 0.0, 0.02, 0.2),
        seed=int(rng.integers(2**32)),
        position=int(rng.integers(10_000)),
        **kw,
    )


def random_logits(rng, n):
    # Flat rows push top-p past the candidates (full sort); peaked rows stay inside them.
    scale = rng.choice([0.3, 1.0, 4.0, 10.0], size=(n, 1))
    return (rng.normal(size=(n, V)) * scale).astype(np.float32)


def with_rep(rows):
    """Make the batch use penalties (a token history HISTORY wide), so it shares one program."""
    return [*rows[:-1], SamplingRow(repetition_penalty=1.2, prompt_token_ids=[3])]


# ---- tests -----------------------------------------------------------------------------------


def test_random_batches_match_the_reference():
    rng = np.random.default_rng()
    for _ in range(12):
        rows = with_rep([random_row(rng) for _ in range(S)])
        logits = random_logits(rng, S)
        out, processed, s = run(logits, rows)
        assert s.token_history.shape == (S, HISTORY)
        assert out.tokens.dtype == np.int32 and out.tokens.shape == (S,)
        for i, r in enumerate(rows):
            check_processed(processed[i], logits[i], r)
            raw = log_softmax(logits[i])
            if r.temperature == 0:
                assert out.tokens[i] == np.argmax(ref_penalise(logits[i], r))
            else:
                assert np.isfinite(processed[i, out.tokens[i]]), "sampled outside the support"
            np.testing.assert_allclose(out.logprobs[i], raw[out.tokens[i]], atol=1e-5)
            top = np.argsort(-raw)[:TOP_LOGPROBS_WIDTH]  # computed at one width, whatever is asked
            np.testing.assert_array_equal(out.top_token_ids[i], top)
            np.testing.assert_allclose(out.top_logprobs[i], raw[top], atol=1e-5)


def test_each_penalty_alone_and_combined():
    # Token 1 is in the prompt only, 3 in the output only (three times), 2 in both.
    prompt, output = [1, 2, 2], [2, 3, 3, 3]
    logits = np.zeros((S, V), np.float32)
    logits[:, 1], logits[:, 2], logits[:, 3], logits[:, 4] = 2.0, -1.0, 3.0, 2.5
    cases = {
        "repetition": (dict(repetition_penalty=1.5), {1: 2 / 1.5, 2: -1.5, 3: 2.0}),
        "frequency": (dict(frequency_penalty=0.5), {1: 2.0, 2: -1.5, 3: 1.5}),
        "presence": (dict(presence_penalty=0.7), {1: 2.0, 2: -1.7, 3: 2.3}),
        "all": (
            dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.7),
            {1: 2 / 1.5, 2: -1.5 - 0.5 - 0.7, 3: 2.0 - 1.5 - 0.7},
        ),
        "none": (dict(), {1: 2.0, 2: -1.0, 3: 3.0}),
    }
    rows = [
        SamplingRow(prompt_token_ids=prompt, output_token_ids=output, **kw)
        for kw, _ in cases.values()
    ]
    out, processed, _ = run(logits, rows)
    for i, (name, (_, expected)) in enumerate(cases.items()):
        want = logits[i].astype(np.float64)
        for t, v in expected.items():
            want[t] = v
        np.testing.assert_allclose(processed[i], want, rtol=1e-6, err_msg=name)
        assert out.tokens[i] == np.argmax(want), name  # greedy takes the penalised argmax
        np.testing.assert_allclose(processed[i], ref_penalise(logits[i], rows[i]), rtol=1e-6)
    # The padding id (= vocab size) lands in the dropped column: the last token is untouched.
    assert np.all(processed[: len(rows), V - 1] == 0)


def test_filters_alone():
    rng = np.random.default_rng()
    logits = random_logits(rng, S)
    logits[0] = 0  # all tied
    for kw in [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=1),
        dict(temperature=1.0, top_k=50),
        dict(temperature=1.0, top_k=400),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=1.0, top_p=0.999),
        dict(temperature=2.0, min_p=0.1),
        dict(temperature=0.5, min_p=1.0),
    ]:
        rows = with_rep([SamplingRow(seed=i, **kw) for i in range(S)])
        out, processed, _ = run(logits, rows)
        assert np.all(np.isfinite(processed[0])), kw  # ties at the threshold all survive
        for i in range(1, S - 1):
            check_processed(processed[i], logits[i], rows[i])
            assert np.isfinite(processed[i, out.tokens[i]])
        if kw.get("top_k") == 1 or kw.get("min_p") == 1.0:
            np.testing.assert_array_equal(out.tokens[1:-1], logits[1:-1].argmax(-1))


def test_temperature_scales_and_samples_the_right_distribution():
    n = 256
    logits = np.full((n, V), -30.0, np.float32)
    logits[:, :4] = [2.0, 1.5, 1.0, 0.6]
    logits[:, 4:10] = 0.5  # outside top_k = 4 below
    counts = np.zeros(V)
    for step in range(8):
        rows = [SamplingRow(temperature=0.7, top_k=4, seed=i, position=step) for i in range(n)]
        out, processed, _ = run(logits, rows, size=n)
        counts += np.bincount(out.tokens, minlength=V)
    np.testing.assert_allclose(processed[0, :4], logits[0, :4] / 0.7, rtol=1e-6)
    assert np.all(np.isneginf(processed[0, 4:]))
    want = softmax(logits[0, :4].astype(np.float64) / 0.7)
    total = counts.sum()
    assert counts[4:].sum() == 0
    sigma = np.sqrt(want * (1 - want) / total)
    np.testing.assert_array_less(np.abs(counts[:4] / total - want), 5 * sigma)


def test_sampled_support_matches_the_filters():
    n = 256
    rng = np.random.default_rng()
    logits = np.repeat(rng.normal(size=(1, V)).astype(np.float32) * 3, n, 0)
    for kw in [dict(top_p=0.6), dict(min_p=0.1), dict(top_k=3, top_p=0.9)]:
        rows = [SamplingRow(temperature=1.0, seed=i, position=7, **kw) for i in range(n)]
        out, processed, _ = run(logits, rows, size=n)
        support = np.flatnonzero(np.isfinite(processed[0]))
        ref = np.flatnonzero(np.isfinite(ref_process(logits[0], rows[0])))
        np.testing.assert_array_equal(support, ref)
        assert set(out.tokens) <= set(support)
        if len(support) <= 8:
            assert set(out.tokens) == set(support), "256 draws should hit every token"


def test_seeded_tokens_ignore_batch_composition_and_row_order():
    rng = np.random.default_rng()
    for _ in range(3):
        rows = with_rep([random_row(rng) for _ in range(S)])
        rows[0] = random_row(rng, penalties=False)
        logits = random_logits(rng, S)
        batch, _, _ = run(logits, rows)
        perm = rng.permutation(S)
        shuffled, _, _ = run(logits[perm], [rows[j] for j in perm])
        for name in SamplerOutput.__dataclass_fields__:
            np.testing.assert_array_equal(getattr(shuffled, name), getattr(batch, name)[perm])
        for i, r in enumerate(rows):
            # Alone, padded with greedy rows, in another slot (and without penalised neighbours,
            # so row 0 runs with one-column token arrays).
            slot = (i + 3) % S
            alone_logits = random_logits(rng, S)
            alone_logits[slot] = logits[i]
            alone_rows = [SamplingRow()] * S
            alone_rows[slot] = r
            alone, _, s = run(alone_logits, alone_rows)
            if i == 0:
                assert s.token_history.shape == (S, 1)
            assert alone.tokens[slot] == batch.tokens[i]
            assert alone.logprobs[slot] == batch.logprobs[i]


def test_different_seeds_or_positions_draw_differently():
    rng = np.random.default_rng()
    logits = np.repeat(rng.normal(size=(1, V)).astype(np.float32), 256, 0)
    by_seed, _, _ = run(logits, [SamplingRow(1.0, seed=i) for i in range(256)], size=256)
    by_pos, _, _ = run(logits, [SamplingRow(1.0, position=i) for i in range(256)], size=256)
    same, _, _ = run(logits, [SamplingRow(1.0, seed=5, position=9)] * 256, size=256)
    assert len(set(by_seed.tokens)) > 100 and len(set(by_pos.tokens)) > 100
    assert len(set(same.tokens)) == 1


def test_padded_rows_are_greedy_no_ops():
    rng = np.random.default_rng()
    rows = [random_row(rng, penalties=True), random_row(rng)]
    s = SamplingInput.build(rows, S, V)
    np.testing.assert_array_equal(s.temperature[2:], 0)
    np.testing.assert_array_equal(s.top_k[2:], 0)
    np.testing.assert_array_equal(s.top_p[2:], 1)
    np.testing.assert_array_equal(s.min_p[2:], 0)
    np.testing.assert_array_equal(s.repetition_penalty[2:], 1)
    np.testing.assert_array_equal(s.presence_penalty[2:], 0)
    np.testing.assert_array_equal(s.frequency_penalty[2:], 0)
    assert np.all(s.token_history[2:] == V) and np.all(s.prompt_lens[2:] == 0)
    logits = random_logits(rng, S)
    out, processed, _ = run(logits, rows)
    np.testing.assert_array_equal(out.tokens[2:], logits[2:].argmax(-1))
    np.testing.assert_allclose(processed[2:], logits[2:])
    assert np.all(np.isfinite(out.logprobs)) and np.all(np.isfinite(out.top_logprobs))


def test_token_history_packs_only_what_penalties_read():
    none = SamplingInput.build([SamplingRow(prompt_token_ids=range(100))], 4, V, history_width=64)
    assert none.token_history.shape == (4, 1) and np.all(none.token_history == V)
    out_only = SamplingInput.build(
        [SamplingRow(presence_penalty=0.5, prompt_token_ids=range(50), output_token_ids=[7])],
        4,
        V,
        history_width=64,
    )
    assert out_only.token_history.shape == (4, 64)  # fixed width: no new program per length
    assert out_only.prompt_lens[0] == 0  # only repetition reads the prompt
    assert out_only.token_history[0, 0] == 7 and np.all(out_only.token_history[0, 1:] == V)
    for n in (0, 16, 40):
        rows = [
            SamplingRow(repetition_penalty=1.1, prompt_token_ids=range(n), output_token_ids=[1]),
            SamplingRow(prompt_token_ids=range(300)),  # neutral: its tokens are not packed
        ]
        s = SamplingInput.build(rows, 2, V, history_width=64)
        assert s.token_history.shape == (2, 64) and list(s.prompt_lens) == [n, 0]
        np.testing.assert_array_equal(s.token_history[0, : n + 1], [*range(n), 1])
        assert np.all(s.token_history[0, n + 1 :] == V) and np.all(s.token_history[1] == V)
        assert s.token_history.dtype == np.int32 and s.seeds.dtype == np.uint32
    with pytest.raises(ValueError, match="history_width=64"):
        SamplingInput.build([SamplingRow(frequency_penalty=1, output_token_ids=[1] * 65)], 2, V,
                            history_width=64)  # fmt: skip
    # Without a fixed width, the longest row's length bucketed.
    s = SamplingInput.build([SamplingRow(repetition_penalty=2, prompt_token_ids=range(17))], 2, V)
    assert s.token_history.shape == (2, 32)
    s = SamplingInput.build([], 2, V)
    assert s.temperature.shape == (2,) and s.token_history.shape == (2, 1)


def test_build_rejects_bad_input():
    with pytest.raises(ValueError, match="size"):
        SamplingInput.build([SamplingRow()] * 3, 2, V)
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingInput.build([SamplingRow(frequency_penalty=1, output_token_ids=[V])], 2, V)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        SamplingInput.build([SamplingRow(repetition_penalty=2, prompt_token_ids=[-1])], 2, V)


def test_top_logprobs_at_one_width_and_none_for_plain_greedy():
    logits = np.random.default_rng(0).normal(size=(256, V)).astype(np.float32)
    out, _, _ = run(logits, [], size=256)
    width = (256, TOP_LOGPROBS_WIDTH)  # one width whatever a row asks: no new program
    assert out.top_token_ids.shape == out.top_logprobs.shape == width
    assert out.top_token_ids.dtype == np.int32
    np.testing.assert_array_equal(out.top_token_ids[:, 0], logits.argmax(-1))
    plain = jax.tree.map(np.asarray, jax.jit(sampler.greedy)(logits))
    assert plain.top_token_ids.shape == plain.top_logprobs.shape == (256, 0)
    assert "top_k" not in str(jax.jit(sampler.greedy).lower(logits).as_text())
    np.testing.assert_array_equal(plain.tokens, out.tokens)
    np.testing.assert_array_equal(plain.logprobs, out.logprobs)
    logits = np.zeros((256, V), np.float32)
    out, _, _ = run(logits, [], size=256)
    np.testing.assert_allclose(out.logprobs, -np.log(V), rtol=1e-6)


def test_real_vocab_size_mixed_batch():
    vocab = 49152  # SmolLM2's
    rng = np.random.default_rng()
    ids = lambda n: rng.integers(0, vocab, n).tolist()
    rows = [
        SamplingRow(),
        SamplingRow(repetition_penalty=1.3, prompt_token_ids=ids(40), output_token_ids=ids(9)),
        SamplingRow(1.0, top_k=50, top_p=0.9, seed=1),
        SamplingRow(0.8, top_p=0.95, seed=2),  # peaked: the nucleus closes inside the candidates
        SamplingRow(1.0, top_p=0.9, seed=3),  # flat: the nucleus needs the full sort
        SamplingRow(1.0, min_p=0.05, seed=4, frequency_penalty=0.5, output_token_ids=ids(5)),
        SamplingRow(0.7, top_k=1000, seed=5),
        SamplingRow(1.2, top_p=0.5, min_p=0.01, seed=6, presence_penalty=1.0),
    ]
    scale = np.array([1, 1, 3, 8, 0.5, 3, 1, 3], np.float32)[:, None]
    logits = (rng.normal(size=(S, vocab)) * scale).astype(np.float32)
    out, processed, _ = run(logits, rows, vocab=vocab)
    for i, r in enumerate(rows):
        check_processed(processed[i], logits[i], r)
        assert np.isfinite(processed[i, out.tokens[i]])
        np.testing.assert_allclose(
            out.logprobs[i], log_softmax(logits[i])[out.tokens[i]], atol=1e-5
        )
    assert out.tokens[1] == np.argmax(ref_penalise(logits[1], rows[1]))


def test_argmax_is_jnp_argmax_on_ties_nans_and_infinities():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((7, 300)).astype(np.float32)
    x[0, [11, 40, 299]] = 9.0  # ties: the first wins
    x[1, [5, 17]] = np.nan  # a NaN wins, the first one
    x[2] = -np.inf  # nothing finite: position 0
    x[3, 0] = np.inf
    x[3, 8] = np.inf
    x[4, 299] = 50.0  # the last position
    x[5, :] = 0.0  # all equal
    x[5, 3] = -0.0
    x[6, 123] = np.nan
    x[6, 0] = np.inf  # NaN beats inf, as in jnp.argmax
    got = np.asarray(jax.jit(sampler.argmax)(x))
    want = np.asarray(jax.numpy.argmax(x, axis=-1))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32 and list(got[:5]) == [11, 5, 0, 0, 299]
    bf16 = jax.numpy.asarray(x, jax.numpy.bfloat16)
    np.testing.assert_array_equal(sampler.argmax(bf16), jax.numpy.argmax(bf16, axis=-1))


def test_greedy_batches_take_the_branchless_program_with_the_same_outputs():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((S, V)).astype(np.float32) * 3
    greedy = [SamplingRow(position=i) for i in range(S - 2)]
    s = SamplingInput.build(greedy, S, V, history_width=HISTORY)
    assert (s.penalties, s.random) == (False, False)
    general = s.replace(penalties=True, random=True)  # the branches, here all not taken
    fast, slow = (jax.tree.map(np.asarray, _run(logits, x)[0]) for x in (s, general))
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(slow), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fast.tokens, np.argmax(logits, axis=-1))
    # One row that samples, or one penalty, switches the batch to the general program; the
    # greedy rows' tokens stay the same.
    mixed = [*greedy, SamplingRow(temperature=0.8, seed=3, position=1)]
    m = SamplingInput.build(mixed, S, V, history_width=HISTORY)
    assert (m.penalties, m.random) == (False, True)
    out = jax.tree.map(np.asarray, _run(logits, m)[0])
    np.testing.assert_array_equal(out.tokens[: S - 2], fast.tokens[: S - 2])
    pen = SamplingInput.build(
        [*greedy, SamplingRow(presence_penalty=0.5, output_token_ids=[1])],
        S,
        V,
        history_width=HISTORY,
    )
    assert (pen.penalties, pen.random) == (True, False)


def test_top_k_within_the_candidates_skips_the_sort_with_the_same_tokens():
    """A sampling batch whose top-ks all lie within the candidates and which has no top-p takes
    the candidates alone (Filters.CANDIDATES, no sort): the same filtered logits and tokens as
    the sort gives, min-p alone included."""
    rng = np.random.default_rng(3)
    logits = random_logits(rng, S)
    logits[0] = 0  # all tied
    rows = [
        SamplingRow(1.0, top_k=k, min_p=m, seed=i)
        for i, (k, m) in enumerate(
            zip((1, 5, 50, 256, 0, 20, 256, 3), (0, 0, 0, 0, 0.1, 0.3, 0.2, 0), strict=True)
        )
    ]
    s = SamplingInput.build(rows, S, V, history_width=HISTORY)
    assert s.filters == sampler.Filters.CANDIDATES
    out, processed = _run(np.asarray(logits, np.float32), s)
    out_sort, processed_sort = _run(
        np.asarray(logits, np.float32), s.replace(filters=sampler.Filters.SORT)
    )
    np.testing.assert_array_equal(np.asarray(processed), np.asarray(processed_sort))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(out_sort.tokens))
    wider = SamplingInput.build([SamplingRow(1.0, top_k=257)], S, V, history_width=HISTORY)
    assert wider.filters == sampler.Filters.SORT  # past the candidates: the sort decides
