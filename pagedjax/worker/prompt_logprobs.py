"""Prompt logprobs: the log-probability of every prompt token under the model, and the top k.

Prompt token ``j`` (``j >= 1``) is scored by the logits at position ``j - 1``, which the step that
computes that position produces: a prefill chunk, whether or not it finishes the prompt. Only the
steps that hold such rows pay for them: there ``logits_indices`` grows by a bucketed block of rows
(``rows_bucket``: powers of four from 32, at most the step's token bucket, so that a prefill shape
has a handful of such programs, ``rows_buckets``) and the step program scores them (``score``)
beside sampling the usual per-sequence rows; the rows' targets travel in the step's packed input.
These programs are compiled with the rest in warm-up and a server's background compile
(worker/warmup_jobs.py), not on a request's first step. Steps without such rows run the usual
programs, unchanged. The runner returns the scores with the step's output (``PromptScores`` per
scheduled sequence) and the step loop stores them into the request's ``PromptLogprobs``.

A cached prefix has no logits, so a request that asks for prompt logprobs does not read the shared
prefix cache (``PromptLogprobs.cache_key``): it computes its whole prompt. After a preemption by
recompute it may hit its own cached blocks, whose rows it has already scored.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pagedjax.worker.sampler import TOP_LOGPROBS_WIDTH

MIN_ROWS_BUCKET = 32  # smallest block of extra logits rows (bounded programs)
ROWS_BUCKET_GROWTH = 4  # each next block of rows this many times the last
_nonce = itertools.count()


@struct.dataclass
class PromptLogprobsOutput:
    logprobs: jax.Array  # f32[P], log-probability of each row's target token
    ranks: jax.Array  # i32[P], 1 + tokens strictly more likely than the target
    top_token_ids: jax.Array  # i32[P, K], most likely tokens, descending
    top_logprobs: jax.Array  # f32[P, K]


@dataclasses.dataclass
class PromptRows:
    """One chunk's rows to score: chunk rows ``first_row ..`` predict ``targets`` (the prompt
    tokens at positions ``first_target ..``)."""

    first_row: int
    first_target: int
    targets: list[int]


@dataclasses.dataclass
class PromptScores:
    """A step's scores of one scheduled sequence's prompt rows (the runner's output, stored
    into its request by the step loop with ``PromptLogprobs.store``)."""

    seq_index: int  # the sequence's index in the step's scheduled sequences
    first_target: int  # the prompt position the first row scores
    scores: PromptLogprobsOutput  # host arrays, one row per target


class PromptLogprobs:
    """One request's prompt logprobs as its chunks are computed (host arrays, by position)."""

    def __init__(self, prompt_token_ids: list[int], k: int):
        n = len(prompt_token_ids)
        self.prompt = list(prompt_token_ids)
        self.k = k
        self.logprobs = np.zeros(n, np.float32)
        self.ranks = np.zeros(n, np.int32)
        self.top_token_ids = np.zeros((n, k), np.int32)
        self.top_logprobs = np.zeros((n, k), np.float32)
        self.next_target = 1  # positions below this are scored (position 0 never is)
        self.cache_key = ("prompt_logprobs", next(_nonce))  # this request's own prefix cache
        self.output = None  # the output processor's list, built once (when done)

    @property
    def done(self) -> bool:
        return self.next_target >= len(self.prompt)

    def rows(self, start: int, num_tokens: int) -> PromptRows | None:
        """The rows still to score in a chunk of ``num_tokens`` tokens from position ``start``."""
        first = max(start, self.next_target - 1)  # positions whose logits score position + 1
        end = min(start + num_tokens, len(self.prompt) - 1)
        if first >= end:
            return None
        return PromptRows(first - start, first + 1, self.prompt[first + 1 : end + 1])

    def store(self, first_target: int, out: PromptLogprobsOutput) -> None:
        """Keep the scores of targets ``first_target ..`` (host arrays, one row each)."""
        stop = first_target + len(out.logprobs)
        self.logprobs[first_target:stop] = out.logprobs
        self.ranks[first_target:stop] = out.ranks
        self.top_token_ids[first_target:stop] = out.top_token_ids[:, : self.k]
        self.top_logprobs[first_target:stop] = out.top_logprobs[:, : self.k]
        self.next_target = max(self.next_target, stop)


def rows_bucket(num_rows: int, num_tokens: int) -> int:
    """The block of logits rows a step of ``num_tokens`` (padded) tokens appends for
    ``num_rows`` prompt rows (at most one per token): the least power of ``ROWS_BUCKET_GROWTH``
    times MIN_ROWS_BUCKET that holds them, or all the step's tokens when that is fewer."""
    size = MIN_ROWS_BUCKET
    while size < num_rows:
        size *= ROWS_BUCKET_GROWTH
    return min(size, max(num_tokens, num_rows))


def rows_buckets(num_tokens: int) -> list[int]:
    """Every block of rows a step of ``num_tokens`` padded tokens can append."""
    out = [rows_bucket(1, num_tokens)]
    while out[-1] < num_tokens:
        out.append(rows_bucket(out[-1] + 1, num_tokens))
    return out


def extend_logits_rows(step_input, seqs) -> tuple[object, np.ndarray | None]:
    """The step input with the rows to score appended to ``logits_indices`` (padded to
    ``rows_bucket``), and their targets (i32[P], padding 0); (step_input, None) when no row is
    asked."""
    rows, targets, row = [], [], 0
    for s in seqs:
        p = s.prompt_rows
        if p is not None:
            rows.extend(range(row + p.first_row, row + p.first_row + len(p.targets)))
            targets.extend(p.targets)
        row += len(s.token_ids)
    if not rows:
        return step_input, None
    size = rows_bucket(len(rows), len(step_input.token_ids))
    padded = np.zeros((2, size), np.int32)
    padded[0, : len(rows)], padded[1, : len(rows)] = rows, targets
    indices = np.concatenate([np.asarray(step_input.logits_indices, np.int32), padded[0]])
    return step_input.replace(logits_indices=indices), padded[1]


def split_scores(seqs, out: PromptLogprobsOutput) -> list[PromptScores]:
    """Each scheduled sequence's rows of ``out`` (host arrays, rows in ``extend_logits_rows``
    order), for the sequences that have rows to score."""
    scores, i = [], 0
    for index, s in enumerate(seqs):
        p = s.prompt_rows
        if p is not None:
            n = len(p.targets)
            rows = jax.tree.map(lambda x, i=i, n=n: x[i : i + n], out)
            scores.append(PromptScores(index, p.first_target, rows))
            i += n
    return scores


def score(logits: jax.Array, targets: jax.Array) -> PromptLogprobsOutput:
    """The prompt rows' scores, inside the step program: logits f32[P, vocab] (the rows to
    score), targets i32[P] (the token each row predicts)."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    target = jnp.take_along_axis(x, targets[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(x > target[:, None], axis=-1, dtype=jnp.int32)
    width = min(TOP_LOGPROBS_WIDTH, x.shape[1])
    top, ids = jax.lax.top_k(x, width)
    return PromptLogprobsOutput(target - lse, ranks, ids.astype(jnp.int32), top - lse[:, None])
