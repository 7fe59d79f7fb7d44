"""Async scheduling's one device op: a step's placeholder tokens take the step before's samples.

A step built before the previous step's tokens reach the host carries, for each such token, the
id ``-1 - r``: row r of the previous step's sampler output, which is still on the device. This
small program fills them in before the model step, so the model-step programs stay as they are.
The previous tokens are first widened (zeros appended, on the device) to one fixed width, the
widest sequence bucket the engine's limits allow (``fill_width``), so the fill compiles once per
token bucket, not once per (token bucket, sequence bucket) pair: with 256 sequences and a
2048-token budget, 5 widen + 9 fill programs instead of 54 fill programs. ``Runner.warmup``
compiles all of them (``warmup_jobs``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.worker.input_batch import widest_seqs_bucket


@jax.jit
def fill_tokens(token_ids: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """token_ids i32[num_tokens] (-1 - r: row r of prev_tokens), prev_tokens i32[rows]."""
    src = jnp.clip(-1 - token_ids, 0, prev_tokens.shape[0] - 1)
    return jnp.where(token_ids < 0, prev_tokens[src], token_ids)


@functools.partial(jax.jit, static_argnums=1)
def _widen(prev_tokens: jax.Array, width: int) -> jax.Array:
    return jnp.pad(prev_tokens, (0, width - prev_tokens.shape[0]))


def fill_width(max_num_seqs: int) -> int:
    """The fixed width previous tokens are widened to: the widest sequence bucket of an engine
    that runs at most ``max_num_seqs`` sequences a step (one sampler row per sequence slot)."""
    return widest_seqs_bucket(max_num_seqs)


def widen(prev_tokens: jax.Array, width: int) -> jax.Array:
    """``prev_tokens`` with zeros appended up to ``width`` rows (as it is when already as wide:
    a step with more sampler rows than sequence slots, e.g. n > 1 first samples, keeps its own
    width and its own fill program)."""
    if prev_tokens.shape[0] >= width:
        return prev_tokens
    return _widen(prev_tokens, width)


def placeholder(row: int) -> int:
    """The token id that stands for row ``row`` of the previous step's sampled tokens."""
    if row < 0:
        raise ValueError(f"row must be >= 0, got {row}")
    return -1 - row


def warmup_jobs(shapes, sharding) -> list[tuple[str, object]]:
    """Runner.warmup's jobs (name, lowering thunk) for the fill: widening each narrower sequence
    bucket of the model-step ``shapes`` to the widest (``fill_width``), and the fill of each
    token bucket from the widest, with inputs placed by ``sharding`` as the steps place them."""
    tokens = sorted({s.num_tokens for s in shapes})
    rows = sorted({s.num_seqs for s in shapes})
    width = rows[-1]

    def lower_widen(r: int):
        return _widen.lower(jax.device_put(np.zeros(r, np.int32), sharding), width)

    def lower_fill(t: int):
        args = (np.zeros(t, np.int32), np.zeros(width, np.int32))
        return fill_tokens.lower(*jax.device_put(args, sharding))

    jobs = [(f"widen_tokens r{r} to {width}", lambda r=r: lower_widen(r)) for r in rows[:-1]]
    return jobs + [(f"fill_tokens t{t} r{width}", lambda t=t: lower_fill(t)) for t in tokens]
