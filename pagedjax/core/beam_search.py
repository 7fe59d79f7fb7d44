"""Beam search inside the engine: one step over a request's live beams, and its final ranking.

Pure Python; imports no jax. A beam is a Sequence; a kept candidate forks its parent (sharing
every block, copy-on-write on the next write), a parent with no kept candidate is freed.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Collection

from pagedjax.core.sequence import Sequence
from pagedjax.sampling_params import BeamSearchParams

Hypothesis = tuple[list[int], float]  # (output token ids, cumulative logprob)


def beam_rank(p: BeamSearchParams, length: int, cumulative_logprob: float) -> tuple[int, float]:
    """What ranks hypotheses: the order of cumulative logprob / output_length **
    length_penalty (vLLM's and HF's score), computed in log space, so that any finite
    length_penalty ranks them (``length ** 1100`` overflows a float). The larger, the better:
    (sign of the score, log of its magnitude, negated for a negative score)."""
    if cumulative_logprob == 0:
        return (0, 0.0)
    log_magnitude = math.log(abs(cumulative_logprob)) - p.length_penalty * math.log(max(length, 1))
    return (1, log_magnitude) if cumulative_logprob > 0 else (-1, -log_magnitude)


def beam_score(p: BeamSearchParams, length: int, cumulative_logprob: float) -> float:
    """Cumulative logprob / output_length ** length_penalty, as a float: 0 or an infinity
    where the score is beyond a float's range (``beam_rank`` orders them all)."""
    sign, key = beam_rank(p, length, cumulative_logprob)
    if sign == 0:
        return 0.0
    log_magnitude = key if sign > 0 else -key
    return sign * (math.inf if log_magnitude > _MAX_LOG else math.exp(log_magnitude))


_MAX_LOG = math.log(sys.float_info.max)


@dataclasses.dataclass
class BeamStep:
    """What one step decided for a request's beams."""

    extend: dict[int, list[tuple[int, float]]]  # seq_id -> its kept (token, logprob)s, best first
    drop: list[Sequence]  # live beams with no kept continuation
    finished: list[Hypothesis]  # hypotheses that ended with EOS among the best
    done: bool  # the search is over: the live beams are final too


def beam_step(
    p: BeamSearchParams,
    beams: list[tuple[Sequence, list[int], list[float]]],  # (beam, top ids, top logprobs)
    finished_so_far: list[Hypothesis],
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> BeamStep:
    """Keep the beam_width best continuations of the live beams (2 * beam_width candidates
    each, so that EOS endings cannot crowd out every live one)."""
    width = p.beam_width
    candidates = []
    for seq, ids, logprobs in beams:
        for token, lp in zip(ids[: 2 * width], logprobs[: 2 * width], strict=True):
            candidates.append((seq.cumulative_logprob + lp, seq, token, lp))
    candidates.sort(key=lambda c: -c[0])
    kept, finished = [], []
    for rank, (score, seq, token, lp) in enumerate(candidates):
        if not p.ignore_eos and token in eos_token_ids:
            if rank < width:  # an ended hypothesis among the best: keep it as a result
                finished.append(([*seq.output_token_ids, token], score))
            continue
        kept.append((seq, token, lp))
        if len(kept) == width:
            break
    extend: dict[int, list[tuple[int, float]]] = {}
    for seq, token, lp in kept:
        extend.setdefault(seq.seq_id, []).append((token, lp))
    drop = [seq for seq, _, _ in beams if seq.seq_id not in extend]

    live = [seq for seq, _, _ in beams if seq.seq_id in extend]
    out_len = max((s.get_output_len() + 1 for s in live), default=0)
    longest = max((s.get_len() + 1 for s in live), default=0)
    done = not live or out_len >= p.max_tokens or longest >= max_model_len
    all_finished = finished_so_far + finished
    if not done and len(all_finished) >= width:
        ranks = sorted((beam_rank(p, len(t), c) for t, c in all_finished), reverse=True)
        worst_kept = ranks[width - 1]
        best_live = max(
            beam_rank(p, s.get_output_len() + 1, s.cumulative_logprob + extend[s.seq_id][0][1])
            for s in live
        )
        done = best_live <= worst_kept
    return BeamStep(extend, drop, finished, done)


def best_hypotheses(p: BeamSearchParams, hypotheses: list[Hypothesis]) -> list[Hypothesis]:
    """The beam_width best, best first."""
    ranked = sorted(hypotheses, key=lambda h: beam_rank(p, len(h[0]), h[1]), reverse=True)
    return ranked[: p.beam_width]


def finish_reason(p: BeamSearchParams, tokens: list[int], eos_token_ids: Collection[int]) -> str:
    return "stop" if tokens and tokens[-1] in eos_token_ids and not p.ignore_eos else "length"
