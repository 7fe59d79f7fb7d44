"""Beam search and the output rules without an engine (plain Python, no jax programs)."""

from __future__ import annotations

import math

import pytest

from pagedjax.core.beam_search import beam_score, beam_step, best_hypotheses
from pagedjax.core.scheduler import check_stop
from pagedjax.core.sequence import Sequence
from pagedjax.engine.output_processor import find_stop_string
from pagedjax.sampling_params import BeamSearchParams, SamplingParams

EOS = 2


def _beam(seq_id: int, outputs: list[int], cum: float) -> Sequence:
    seq = Sequence(seq_id, [7, 8, 9], block_size=8)
    for t in outputs:
        seq.append_token_id(t, 0.0)
    seq.cumulative_logprob = cum
    return seq


def test_keeps_the_best_width_continuations_across_beams():
    p = BeamSearchParams(beam_width=2, max_tokens=8)
    a, b = _beam(0, [5], -1.0), _beam(1, [6], -0.5)
    step = beam_step(
        p,
        [(a, [10, 11, 12, 13], [-0.1, -0.2, -3, -4]), (b, [20, 21, 22, 23], [-1.0, -2, -3, -4])],
        [],
        {EOS},
        max_model_len=64,
    )
    # Scores: a+10 = -1.1, a+11 = -1.2, b+20 = -1.5: the two best both extend a.
    assert step.extend == {0: [(10, -0.1), (11, -0.2)]}
    assert step.drop == [b] and not step.finished and not step.done


def test_an_eos_among_the_best_is_a_finished_hypothesis_not_a_live_beam():
    p = BeamSearchParams(beam_width=2, max_tokens=8)
    a = _beam(0, [5], -1.0)
    step = beam_step(p, [(a, [EOS, 11, 12, 13], [-0.1, -0.2, -0.3, -4])], [], {EOS}, 64)
    assert step.finished == [([5, EOS], -1.1)]
    assert step.extend == {0: [(11, -0.2), (12, -0.3)]}  # still beam_width live beams
    ignoring = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    step = beam_step(ignoring, [(a, [EOS, 11, 12, 13], [-0.1, -0.2, -0.3, -4])], [], {EOS}, 64)
    assert step.extend == {0: [(EOS, -0.1), (11, -0.2)]} and not step.finished


def test_done_at_max_tokens_or_when_no_live_beam_can_win():
    p = BeamSearchParams(beam_width=1, max_tokens=2)
    a = _beam(0, [5], -1.0)
    assert beam_step(p, [(a, [10, 11], [-0.1, -0.2])], [], {EOS}, 64).done  # 2 tokens now
    p = BeamSearchParams(beam_width=1, max_tokens=8)
    step = beam_step(p, [(a, [10, 11], [-5.0, -6.0])], [([4, EOS], -0.5)], {EOS}, 64)
    assert step.done  # the finished -0.5 / 2 beats any extension of -6 / 2
    step = beam_step(p, [(a, [10, 11], [-0.1, -6.0])], [([4, EOS], -3.0)], {EOS}, 64)
    assert not step.done


def test_length_penalty_ranks_hypotheses():
    p = BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=1.0)
    hyps = [([1], -1.0), ([1, 2, 3, 4], -2.0), ([1, 2], -3.0)]
    assert best_hypotheses(p, hyps) == [([1, 2, 3, 4], -2.0), ([1], -1.0)]
    assert math.isclose(beam_score(p, 4, -2.0), -0.5)


def test_check_stop_order_eos_stop_token_then_length():
    p = SamplingParams(max_tokens=2, stop_token_ids=[9])
    seq = Sequence(0, [7], block_size=8)
    seq.append_token_id(5)
    assert check_stop(seq, p, {EOS}, 64) is None
    seq.append_token_id(9)
    assert check_stop(seq, p, {EOS}, 64) == "stop"  # a stop token on the last allowed one
    seq = Sequence(1, [7], block_size=8)
    seq.append_token_id(EOS)
    assert check_stop(seq, SamplingParams(ignore_eos=True), {EOS}, 64) is None
    assert check_stop(seq, SamplingParams(ignore_eos=True), {EOS}, 2) == "length"


def test_stop_strings_are_searched_only_where_a_new_match_can_start():
    stops = ["abc", "zz"]
    assert find_stop_string("xxab", 0, stops) == -1
    assert find_stop_string("xxabc", 4, stops) == 2  # starts in the old text, ends in the new
    assert find_stop_string("zzq abc", 7, stops) == -1  # all of it was searched before
    assert find_stop_string("q zz abc", 3, stops) == 2  # the earliest of several


@pytest.mark.parametrize("penalty", [1100.0, -1100.0, 1e300, -1e300, 0.0])
def test_any_finite_length_penalty_ranks_without_overflow(penalty):
    """Scores ranked in log space: ``length ** 1100`` overflows a float (an OverflowError, a
    500 on the server); the order is still the true scores' order."""
    p = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=penalty)
    hyps = [([1], -1.0), ([1, 2, 3, 4], -2.0), ([1, 2], -3.0)]
    ranked = best_hypotheses(p, hyps)
    by_length = [len(t) for t, _ in ranked]
    if penalty > 0:  # long hypotheses' scores shrink towards 0: the longest first
        assert by_length == [4, 2, 1]
    elif penalty < 0:
        assert by_length == [1, 2, 4]
    else:  # plain cumulative logprob
        assert by_length == [1, 4, 2]
    assert beam_score(p, 4, 0.0) == 0.0
    want = -2.0 if penalty == 0 else (-0.0 if penalty > 0 else -math.inf)  # beyond a float
    assert beam_score(p, 4, -2.0) == want
    # the step's early stop compares in log space too
    a = _beam(0, [5], -1.0)
    beam_step(p, [(a, [10, 11], [-0.1, -6.0])], [([4, EOS], -3.0)] * 3, {EOS}, 64)
