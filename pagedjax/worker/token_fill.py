"""Async scheduling's one device op: a step's placeholder tokens take the step before's samples.

A step built before the previous step's tokens reach the host carries, for each such token, the
id ``-1 - r``: row r of the previous step's sampler output, which is still on the device. This
small program fills them in before the model step, so the model-step programs stay as they are.
Its shapes: a step's token bucket x the previous step's sampler rows (a sequence bucket);
``Runner.warmup`` compiles every pair the engine's limits allow (``warmup_jobs``).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def fill_tokens(token_ids: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """token_ids i32[num_tokens] (-1 - r: row r of prev_tokens), prev_tokens i32[rows]."""
    src = jnp.clip(-1 - token_ids, 0, prev_tokens.shape[0] - 1)
    return jnp.where(token_ids < 0, prev_tokens[src], token_ids)


def placeholder(row: int) -> int:
    """The token id that stands for row ``row`` of the previous step's sampled tokens."""
    if row < 0:
        raise ValueError(f"row must be >= 0, got {row}")
    return -1 - row


def warmup_jobs(shapes, sharding) -> list[tuple[str, object]]:
    """Runner.warmup's jobs (name, lowering thunk) for fill_tokens: every (token bucket, sequence
    bucket) pair of the model-step ``shapes`` (a plain runner: one sampler row per sequence
    slot), with inputs placed by ``sharding`` as the steps place them."""
    tokens = sorted({s.num_tokens for s in shapes})
    rows = sorted({s.num_seqs for s in shapes})

    def lower(t: int, r: int):
        args = (np.zeros(t, np.int32), np.zeros(r, np.int32))
        return fill_tokens.lower(*jax.device_put(args, sharding))

    return [
        (f"fill_tokens t{t} r{r}", lambda t=t, r=r: lower(t, r))
        for t, r in itertools.product(tokens, rows)
    ]
