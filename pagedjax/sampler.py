"""On-device sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

A request's random key is ``fold_in(fold_in(BASE_KEY, seed), position)``: its tokens depend only on
its seed, its logits and the position being sampled, never on which requests share the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_BASE_SEED = 0


@struct.dataclass
class SamplingInput:
    temperature: jax.Array  # f32[num_seqs], 0 = greedy
    top_k: jax.Array  # i32[num_seqs], <= 0 = off
    top_p: jax.Array  # f32[num_seqs], 1 = off
    min_p: jax.Array  # f32[num_seqs], 0 = off
    seeds: jax.Array  # u32[num_seqs]
    positions: jax.Array  # i32[num_seqs], position of the token being sampled

    @classmethod
    def from_rows(cls, rows: list[tuple[float, int, float, float, int, int]], size: int):
        """Pack (temperature, top_k, top_p, min_p, seed, position) rows, padded to ``size``."""
        cols = list(zip(*rows, strict=True)) if rows else [()] * 6
        pad = size - len(rows)

        def col(i, dtype, fill):
            return np.asarray(list(cols[i]) + [fill] * pad, dtype=dtype)

        return cls(
            col(0, np.float32, 0.0),
            col(1, np.int32, 0),
            col(2, np.float32, 1.0),
            col(3, np.float32, 0.0),
            col(4, np.uint32, 0),
            col(5, np.int32, 0),
        )


def _filter_logits(logits: jax.Array, s: SamplingInput) -> jax.Array:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus, or below min-p x max prob."""
    order = jnp.argsort(-logits, axis=-1)  # [num_seqs, vocab]
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    drop = (s.top_k[:, None] > 0) & (rank >= s.top_k[:, None])
    drop |= mass_before >= s.top_p[:, None]
    drop |= probs < s.min_p[:, None] * probs[:, :1]
    drop &= rank > 0  # the most likely token always survives
    filtered = jnp.where(drop, -jnp.inf, sorted_logits)
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.empty_like(logits).at[rows, order].set(filtered)


def sample(logits: jax.Array, s: SamplingInput) -> tuple[jax.Array, jax.Array]:
    """logits f32[num_seqs, vocab] -> (token i32[num_seqs], logprob f32[num_seqs]).

    The logprob is the model's (unscaled) log-probability of the chosen token.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)
    scaled = logits / temp[:, None]
    needs_filter = jnp.any((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0))
    scaled = jax.lax.cond(needs_filter, _filter_logits, lambda x, _: x, scaled, s)
    base = jax.random.key(_BASE_SEED)
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.fold_in(base, seed), pos))(
        s.seeds, s.positions
    )
    sampled = jax.vmap(jax.random.categorical)(keys, scaled)
    tokens = jnp.where(s.temperature > 0, sampled, greedy).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
