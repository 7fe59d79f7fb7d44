"""On-device sampling with vLLM's semantics: penalties, temperature, min-p / top-k / top-p, seeds.

Order: logit bias and the allowed-token bitmask (structured output) first, then repetition penalty
(tokens seen in the prompt or the output), frequency and presence penalties (output tokens),
temperature, then min-p, top-k and top-p, each filter renormalising what the one before it left
(top-p's mass is measured over the survivors of min-p and top-k, as in vLLM). Greedy rows
(temperature 0) take the argmax of the penalised logits. Logprobs, of the sampled token and of the
top K, are the raw model's (log_softmax of the unprocessed logits).

A request's random key is ``fold_in(fold_in(BASE_KEY, seed), position)``: its tokens depend only on
its seed, its logits and the position being sampled, never on which requests share the batch.

Filtering keeps every token at or above a per-row threshold logit (ties at the threshold survive),
so it never scatters a permutation back. The threshold comes from the ``_NUM_CANDIDATES`` largest
logits (``lax.top_k``) when they decide it exactly (top-k <= that many, or a nucleus that closes
inside them), else from a full sort; each row takes the one its own settings and logits pick,
whatever shares its batch, so the sort cannot change another row's tokens.

Nothing here branches on data (no ``lax.cond`` or loop): on a GPU a conditional makes the host wait
for the device before it can dispatch the next program. Sampling is data (worker/sampling_input.py):
what a batch needs beyond that is decided on the host from its rows, as a few static fields of
``SamplingInput``: whether some row has a penalty, whether the batch is constrained, whether some
row samples, and whether some sampling row has top-p or a top-k past the candidates (``Filters``:
a sampling batch takes the candidates, and only a batch with such a row also takes, for the rows
they do not decide, the full sort). Top logprobs are computed
at one width whenever a sampler runs. A greedy batch without penalties, bias or logprobs needs no
sampler: the step program takes its argmax (``greedy``).

Every input here has a shape set by the batch's row count alone (plus one token-history width when
some row uses penalties, and one bias width and bitmask width in a constrained batch), so a new
request never compiles (the runner's warm-up compiles each variant). A decode step without
penalties, bias or masks samples inside the model's step program (worker/step_program.py: three
variants at most per decode shape), everything else runs sampling as a program of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pagedjax.worker.sampling_input import (
    MODES,
    NUM_CANDIDATES,
    TOP_LOGPROBS_WIDTH,
    Filters,
    SamplingInput,
    SamplingRow,
    Variant,
    bitmask_width,
    needs_own_program,
    plain_greedy,
    variants,
)

_BASE_SEED = 0
_NUM_CANDIDATES = NUM_CANDIDATES  # logits per row top-k / top-p look at before a full sort


@struct.dataclass
class SamplerOutput:
    tokens: jax.Array  # i32[num_seqs], the sampled token
    logprobs: jax.Array  # f32[num_seqs], its log-probability under the raw model
    # i32[num_seqs, K], most likely tokens under the raw model, descending (K = TOP_LOGPROBS_WIDTH
    # or the vocabulary if smaller; 0 when no row asked for them)
    top_token_ids: jax.Array
    top_logprobs: jax.Array  # f32[num_seqs, K], their raw log-probabilities


def _apply_penalties(logits: jax.Array, s: SamplingInput) -> jax.Array:
    num_seqs, vocab = logits.shape
    rows = jnp.arange(num_seqs)[:, None]
    is_output = jnp.arange(s.token_history.shape[1])[None, :] >= s.prompt_lens[:, None]
    # Padding ids (= vocab) land in the extra column, which is dropped.
    output_ids = jnp.where(is_output, s.token_history, vocab)
    prompt_ids = jnp.where(is_output, vocab, s.token_history)
    counts = jnp.zeros((num_seqs, vocab + 1), jnp.int32)
    counts = counts.at[rows, output_ids].add(1, mode="drop")[:, :vocab]  # [num_seqs, vocab]
    in_prompt = jnp.zeros((num_seqs, vocab + 1), jnp.bool_)
    in_prompt = in_prompt.at[rows, prompt_ids].set(True, mode="drop")[:, :vocab]
    in_output = counts > 0
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(
        in_prompt | in_output, jnp.where(logits > 0, logits / rep, logits * rep), logits
    )
    logits -= s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * in_output


def _constrain(logits: jax.Array, s: SamplingInput) -> jax.Array:
    """Add the logit biases and set disallowed tokens to -inf (a no-op without columns)."""
    if s.token_bitmask.shape[1] == 0:  # static: no row has a bias or a grammar
        return logits
    num_seqs, vocab = logits.shape
    rows = jnp.arange(num_seqs)[:, None]
    logits = logits.at[rows, s.bias_ids].add(s.bias_values, mode="drop")  # padding ids drop
    token = jnp.arange(vocab)
    words = s.token_bitmask[:, token // 32]  # [num_seqs, vocab]
    return jnp.where((words >> (token % 32)) & 1 == 1, logits, -jnp.inf)


def _scale(logits: jax.Array, s: SamplingInput) -> jax.Array:
    return logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]


def _sort_descending(x: jax.Array) -> jax.Array:
    # Sorting float bits mapped to order-preserving int32 keys is several times faster on CPU than
    # XLA's float comparator; ~key reverses the order without overflow.
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = ~jax.lax.sort(~keys, dimension=1, is_stable=False)
    return jax.lax.bitcast_convert_type(keys ^ ((keys >> 31) & 0x7FFFFFFF), jnp.float32)


def _cutoff(xs, row_max, n1, in_xs, mass_outside, top_p, top_k_on):
    """Threshold from xs f32[num_seqs, C], a row's C largest logits, descending.

    n1 i32[num_seqs]: survivors of min-p and top-k (a prefix); in_xs: whether that prefix lies
    within xs, else its softmax mass (relative to the max) is mass_outside. Returns the threshold
    and whether xs decided it exactly.
    """
    width = xs.shape[1]
    rank = jnp.arange(width)[None, :]
    alive = rank < n1[:, None]
    e = jnp.where(alive, jnp.exp(xs - row_max[:, None]), 0.0)
    cum = jnp.cumsum(e, axis=-1)
    total = jnp.where(in_xs, cum[:, -1], mass_outside)
    # A token stays in the nucleus while the mass ranked above it is below top_p.
    n_p = jnp.sum(alive & (cum - e < top_p[:, None] * total[:, None]), axis=-1)
    n_keep = jnp.maximum(jnp.where(top_p < 1, n_p, n1), 1)
    threshold = jnp.take_along_axis(xs, n_keep[:, None] - 1, axis=-1)[:, 0]
    exact = in_xs | (~top_k_on & (top_p < 1) & (n_p < width))
    return threshold, exact


def _threshold(x: jax.Array, s: SamplingInput, active: jax.Array) -> jax.Array:
    """f32[num_seqs]: the smallest logit each row keeps (only rows in `active` need top-k/p).
    Which of the candidates' and the full sort's thresholds a row takes depends on its own
    settings and logits alone; ``s.filters`` only says which of them some row needs."""
    num_seqs, vocab = x.shape
    row_max = jnp.max(x, axis=-1)
    min_p_threshold = row_max + jnp.log(s.min_p)  # p >= min_p * p_max, in logit space
    if s.filters == Filters.MIN_P:  # static: no row samples
        return jnp.minimum(min_p_threshold, row_max)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    top_k_on = k < vocab
    sorts = active & (top_k_on | (s.top_p < 1))

    def survivors(xs):
        return jnp.minimum(k, jnp.sum(xs >= min_p_threshold[:, None], axis=-1))

    width = min(vocab, _NUM_CANDIDATES)
    # The barrier keeps XLA from merging slices into the top-k, which (on CPU) turns it back
    # into a full sort.
    xs = jax.lax.optimization_barrier(jax.lax.top_k(x, width)[0])  # [num_seqs, width]
    n1 = survivors(xs)
    if s.filters == Filters.CANDIDATES:  # static: no top-p, no top-k past the candidates
        threshold = jnp.take_along_axis(xs, jnp.maximum(n1, 1)[:, None] - 1, axis=-1)[:, 0]
        threshold = jnp.where(sorts, threshold, min_p_threshold)
        return jnp.minimum(threshold, row_max)
    in_xs = (k <= width) | (n1 < width)
    # The mass of min-p's survivors, which a nucleus past the candidates is measured against.
    kept = jnp.where(x >= min_p_threshold[:, None], jnp.exp(x - row_max[:, None]), 0.0)
    mass_outside = jnp.sum(kept, -1)
    threshold, exact = _cutoff(xs, row_max, n1, in_xs, mass_outside, s.top_p, top_k_on)
    xs = _sort_descending(x)
    full, _ = _cutoff(xs, row_max, survivors(xs), True, mass_outside, s.top_p, top_k_on)
    threshold = jnp.where(exact, threshold, full)
    threshold = jnp.where(sorts, threshold, min_p_threshold)
    return jnp.minimum(threshold, row_max)  # the most likely token always survives


def _filter(x: jax.Array, s: SamplingInput, active: jax.Array) -> jax.Array:
    return jnp.where(x >= _threshold(x, s, active)[:, None], x, -jnp.inf)


def process_logits(logits: jax.Array, s: SamplingInput) -> jax.Array:
    """f32[num_seqs, vocab]: penalised, temperature-scaled (greedy rows unscaled) and filtered
    logits (-inf outside min-p / top-k / top-p): what a sampled row draws from."""
    x = _constrain(logits.astype(jnp.float32), s)
    if s.penalties:  # static: some row has a penalty
        x = _apply_penalties(x, s)
    return _filter(_scale(x, s), s, jnp.ones(x.shape[0], jnp.bool_))


def argmax(x: jax.Array) -> jax.Array:
    """i32[...]: ``jnp.argmax(x, axis=-1)`` (the first maximum; the first NaN if any), as a max
    then a min over the positions that hold it. XLA's CPU backend runs argmax's paired
    (value, index) reduction element by element; these two plain reductions vectorize (the greedy
    sampler program at 64 rows of a 49152-token vocabulary: 4.8 ms, 11.9 ms with jnp.argmax)."""
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN if any element is NaN
    positions = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, positions, x.shape[-1]), axis=-1)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One key per row, ``fold_in(fold_in(BASE_KEY, seed), position)``: batch-invariant."""
    base = jax.random.key(_BASE_SEED)
    fold = jax.random.fold_in
    return jax.vmap(lambda seed, pos: fold(fold(base, seed), pos))(seeds, positions)


def sample(logits: jax.Array, s: SamplingInput) -> SamplerOutput:
    """logits f32[num_seqs, vocab] -> one token per row, with raw logprobs (pure, jittable)."""
    logits = logits.astype(jnp.float32)
    penalised = _constrain(logits, s)
    if s.penalties:  # static: some row has a penalty
        penalised = _apply_penalties(penalised, s)
    tokens = greedy = argmax(penalised)
    if s.random:  # static: some row samples
        random = s.temperature > 0
        x = _filter(_scale(penalised, s), s, random)
        sampled = jax.vmap(jax.random.categorical)(row_keys(s.seeds, s.positions), x)
        tokens = jnp.where(random, sampled, greedy)
    return _with_logprobs(logits, tokens.astype(jnp.int32), True)


def greedy(logits: jax.Array) -> SamplerOutput:
    """``sample`` for a batch of plain greedy rows (no penalty, bias, mask or top logprobs):
    its tokens and logprobs bit for bit, no top logprobs, no sampling input at all (the step
    program runs it)."""
    logits = logits.astype(jnp.float32)
    return _with_logprobs(logits, argmax(logits).astype(jnp.int32), False)


def _with_logprobs(logits: jax.Array, tokens: jax.Array, top_logprobs: bool) -> SamplerOutput:
    lse = jax.nn.logsumexp(logits, axis=-1)  # [num_seqs]
    # Top logprobs at one width whatever a row asks (no new program); none in a plain greedy batch.
    width = min(TOP_LOGPROBS_WIDTH, logits.shape[1]) if top_logprobs else 0
    if width:
        top_logits, top_ids = jax.lax.top_k(logits, width)  # [num_seqs, K]
    else:
        top_logits = jnp.zeros((logits.shape[0], 0), logits.dtype)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SamplerOutput(
        tokens=tokens,
        logprobs=jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse,
        top_token_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_logits - lse[:, None],
    )


__all__ = [
    "TOP_LOGPROBS_WIDTH",
    "argmax",
    "greedy",
    "bitmask_width",
    "SamplerOutput",
    "SamplingInput",
    "SamplingRow",
    "Filters",
    "Variant",
    "variants",
    "MODES",
    "needs_own_program",
    "plain_greedy",
    "process_logits",
    "row_keys",
    "sample",
]
