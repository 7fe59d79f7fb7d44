"""Verifying proposed tokens on the device: rejection sampling that keeps the target's distribution.

Row r holds the target model's logits at one position and the token proposed for that position
(``draft_ids[r]``, -1 for none). With p the target's distribution under the request's sampling
settings (logit bias, penalties, temperature, min-p / top-k / top-p: the sampler's
``process_logits``) and q the proposer's:

- a greedy row accepts the proposal when it is the target's argmax, and its token is the argmax;
- a random row accepts proposal x with probability min(1, p(x) / q(x)); on rejection its token is
  drawn from the residual max(0, p - q), normalised. A deterministic proposer (n-gram) has q
  one-hot on x: accept with probability p(x), else draw from p with x taken out;
- a row without a proposal emits the sampler's own token (what ``sample`` draws), so a sequence
  that proposed nothing gets exactly the token plain decoding gives it.

Every emitted token is then distributed exactly as p given the tokens before it (Leviathan et al.
2023, Chen et al. 2023). Randomness is per request and position, as in the sampler: the row's key
``fold_in(fold_in(BASE, seed), position)``, folded with 1 for the acceptance draw and with 2 for
the residual draw, so results never depend on what shares the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pagedjax.worker.sampler import SamplingInput, process_logits, row_keys, sample


@struct.dataclass
class VerifyOutput:
    tokens: jax.Array  # i32[rows], the token a row emits when verification reaches it
    accepted: jax.Array  # bool[rows], the row accepted its proposal (its token is the proposal)
    logprobs: jax.Array  # f32[rows], the token's log-probability under the raw model
    top_token_ids: jax.Array  # i32[rows, K], as SamplerOutput
    top_logprobs: jax.Array  # f32[rows, K]


def _take(x: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, ids[:, None], axis=-1)[:, 0]


def rejection_sample(
    logits: jax.Array,
    s: SamplingInput,
    draft_ids: jax.Array,
    draft_probs: jax.Array | None = None,
) -> VerifyOutput:
    """logits f32[rows, vocab], draft_ids i32[rows] (-1: no proposal), draft_probs f32[rows,
    vocab] (the proposer's q; None: one-hot on the proposal) -> VerifyOutput (pure, jittable)."""
    logits = logits.astype(jnp.float32)
    base = sample(logits, s)  # the target's own token: greedy rows, rows without a proposal
    has = draft_ids >= 0
    d = jnp.where(has, draft_ids, 0)
    random = has & (s.temperature > 0)

    def verify_random(_):
        x = process_logits(logits, s)  # [rows, vocab], -inf outside the filters
        p = jax.nn.softmax(x, axis=-1)
        keys = row_keys(s.seeds, s.positions)
        fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
        u = jax.vmap(jax.random.uniform)(fold(keys, 1))  # [rows] in [0, 1)
        p_d = _take(p, d)
        if draft_probs is None:
            accept = u < p_d
            residual = jnp.where(jnp.arange(x.shape[1]) == d[:, None], -jnp.inf, x)
        else:
            q = draft_probs.astype(jnp.float32)
            accept = u * _take(q, d) < p_d  # u < p / q without dividing by q
            residual = jnp.log(jnp.maximum(p - q, 0.0))
        # A residual with no mass goes with an acceptance probability of 1: never drawn from.
        return accept, jax.vmap(jax.random.categorical)(fold(keys, 2), residual)

    if s.random:  # static: some row samples (no branch on data: the host never waits)
        accept, recovered = verify_random(None)
    else:
        accept, recovered = jnp.zeros_like(has), jnp.zeros_like(d)
    accepted = has & jnp.where(random, accept, base.tokens == d)
    tokens = jnp.where(accepted, d, jnp.where(random, recovered, base.tokens)).astype(jnp.int32)
    return VerifyOutput(
        tokens=tokens,
        accepted=accepted,
        logprobs=jnp.where(
            tokens == base.tokens,
            base.logprobs,  # bit for bit what plain decoding reports
            _take(logits, tokens) - jax.nn.logsumexp(logits, axis=-1),
        ),
        top_token_ids=base.top_token_ids,
        top_logprobs=base.top_logprobs,
    )


def _verify_step(logits, logit_rows, sampling, draft_ids, draft_probs=None):
    # logits: f32[num_logits, vocab]; logit_rows, draft_ids: i32[num_rows]; draft_probs: None
    # (n-gram: one-hot) or f32[num_rows, vocab] (a draft model's q on its proposals' rows)
    return rejection_sample(logits[logit_rows], sampling, draft_ids, draft_probs)


# The runner's sampler program when the engine speculates (one per sampler shape, as ``sample``).
verify_step = jax.jit(_verify_step)
