"""Prompt logprobs: the log-probability of every prompt token under the model, and the top k.

Prompt token ``j`` (``j >= 1``) is scored by the logits at position ``j - 1``, which the step that
computes that position produces: a prefill chunk, whether or not it finishes the prompt. Every
step program returns the last layer's output of each of its token rows (worker/programs.py), and a
step that holds such rows scores them from it with the score program (``score``: the model's
head on the rows, then log-softmax, rank and top k), in chunks of at most ``CHUNK_ROWS`` rows
(``chunks``): one score program per token bucket, whatever the number of rows, so prompt
logprobs never multiply the model's programs. Steps without such rows run nothing more. The
runner returns the scores with the step's output (``PromptScores`` per scheduled sequence) and the
step loop stores them into the request's ``PromptLogprobs``.

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

# Rows a score program scores at once (its logits are [rows, vocab]): at most this many.
CHUNK_ROWS = 256
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


def chunk_rows(num_tokens: int) -> int:
    """Rows per score program call in a step of ``num_tokens`` (padded) token rows."""
    return min(num_tokens, CHUNK_ROWS)


def chunks(seqs, num_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The step's rows to score and their targets (the prompt token each row predicts), in
    chunks of ``chunk_rows(num_tokens)`` (i32 each, padded with row 0 and target 0), sequence
    by sequence; [] when no row is asked."""
    rows, targets, row = [], [], 0
    for s in seqs:
        p = s.prompt_rows
        if p is not None:
            rows.extend(range(row + p.first_row, row + p.first_row + len(p.targets)))
            targets.extend(p.targets)
        row += len(s.token_ids)
    size = chunk_rows(num_tokens)
    out = []
    for start in range(0, len(rows), size):
        padded = np.zeros((2, size), np.int32)
        n = len(rows[start : start + size])
        padded[0, :n], padded[1, :n] = rows[start : start + size], targets[start : start + size]
        out.append((padded[0], padded[1]))
    return out


def concat(outs: list[PromptLogprobsOutput]) -> PromptLogprobsOutput:
    """The chunks' scores (host arrays) as one, rows in order."""
    return jax.tree.map(lambda *xs: np.concatenate(xs), *outs)


def split_scores(seqs, out: PromptLogprobsOutput) -> list[PromptScores]:
    """Each scheduled sequence's rows of ``out`` (host arrays, rows in ``chunks``' order), for
    the sequences that have rows to score."""
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
    """The prompt rows' scores, inside the score program: logits f32[P, vocab] (the rows to
    score), targets i32[P] (the token each row predicts)."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    target = jnp.take_along_axis(x, targets[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(x > target[:, None], axis=-1, dtype=jnp.int32)
    width = min(TOP_LOGPROBS_WIDTH, x.shape[1])
    top, ids = jax.lax.top_k(x, width)
    return PromptLogprobsOutput(target - lse, ranks, ids.astype(jnp.int32), top - lse[:, None])
