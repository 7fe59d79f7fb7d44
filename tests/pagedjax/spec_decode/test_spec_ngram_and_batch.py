"""The n-gram proposer against a brute-force definition, the speculative config's validation, and
the step input's logits rows when sequences verify proposals."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.config import EngineConfig
from pagedjax.spec_decode.config import SpeculativeConfig
from pagedjax.spec_decode.ngram import NgramProposer
from pagedjax.worker.input_batch import InputBatcher, ScheduledSeq
from pagedjax.worker.sampler import SamplingRow


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the earliest occurrence of the longest suffix (min_n .. max_n tokens)
    that also occurs ending before the last token."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        for start in range(0, num - n):  # the occurrence ends at start + n <= num - 1
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposals_match_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 6))
        k = int(rng.integers(1, 6))
        want = brute_force(tokens, lo, hi, k)
        assert NgramProposer(lo, hi).propose(tokens, k) == want, (tokens, lo, hi, k)


def test_examples():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # the 3-gram [1, 2, 3]
    assert p.propose([7, 2, 5, 2, 9, 7, 2], 3) == [5, 2, 9]  # [7, 2] beats the earlier [2]
    assert p.propose([1, 2, 3], 4) == []  # nothing repeats
    assert p.propose([4, 4], 4) == [4]  # never past the end
    assert p.propose([4], 4) == []
    assert NgramProposer(2, 2).propose([5, 6, 5, 7, 5], 2) == []  # only 1-gram matches


def test_config_validation():
    cfg = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    cfg = SpeculativeConfig.of(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    assert EngineConfig(model="m", speculative_config=cfg).speculative_config is cfg
    for bad, match in [
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "n": 1}, r"unknown keys \['n'\]"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "must be <= 32"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)",
        ),
        ("ngram", "must be a dict"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model path"),
        (
            {
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": "m",
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_\\* are for method 'ngram'",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "is for method"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", speculative_config=bad)


def test_logits_rows_of_a_speculative_step():
    """Sequence i owns logits rows i*F .. i*F + F - 1; the first 1 + p are its last tokens."""
    batcher = InputBatcher(4, 64, logits_per_seq=4)
    row = SamplingRow()
    seqs = [
        ScheduledSeq([9, 1, 2, 3], 5, [1, 2, 3], [row] * 4, num_spec_tokens=3),  # decode + 3
        ScheduledSeq([5, 6, 7, 8, 9], 0, [4, 5], [row]),  # a prompt
        ScheduledSeq([4, 8], 2, [6], [row] * 2, num_spec_tokens=1),
        ScheduledSeq([3], 7, [7, 8], [row, row]),  # a prompt's last token, two samples
    ]
    step = batcher.build(seqs)
    assert len(step.logits_indices) == 8 * 4  # the smallest sequence bucket, times F
    np.testing.assert_array_equal(
        step.logits_indices[:16], [0, 1, 2, 3, 8, 0, 0, 0] + [9, 10] + [0] * 2 + [11, 0, 0, 0]
    )
    logit_rows, drafts = batcher.sample_rows(seqs, step)
    np.testing.assert_array_equal(logit_rows[:9], [0, 1, 2, 3, 4, 8, 9, 12, 12])
    np.testing.assert_array_equal(drafts[:9], [1, 2, 3, -1, -1, 8, -1, -1, -1])
    assert (drafts[9:] == -1).all()
    plain = InputBatcher(4, 64)
    assert plain.sample_rows(seqs[1:2], plain.build(seqs[1:2]))[1] is None  # no draft column
    # A decode step verifies nothing: one logits row per sequence slot, no draft column.
    decode = [ScheduledSeq([7], 9, [1, 2, 3], [row]), ScheduledSeq([8], 3, [4], [row] * 3)]
    step = batcher.build(decode)
    assert step.max_query_len == 1 and len(step.logits_indices) == 8
    np.testing.assert_array_equal(step.logits_indices[:2], [0, 1])
    logit_rows, drafts = batcher.sample_rows(decode, step)
    assert drafts is None and logit_rows[:4].tolist() == [0, 1, 1, 1]
