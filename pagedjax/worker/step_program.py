"""One program per step: what the runner's step program does around the model, and its packing.

A step's host inputs (the ``StepInput`` arrays and the sampler's logits rows, all int32) travel
as ONE buffer, one transfer (``pack_inputs``); the program slices them back out at offsets its
static ``StepLayout`` fixes. Inside the same program, before the model, placeholder tokens take
the previous step's sampled tokens (async scheduling: id ``-1 - r``, core/in_flight.py's
``placeholder(r)``, is row r of ``prev_tokens``, an i32[W] array still on the device; W =
``fill_width``, every step's tokens are widened or cut to it, so there is no program per pair of
widths); after the model, the sampler's logits rows
are gathered and a plain greedy batch is sampled there too (``sampler.greedy``: argmax and
logprobs, no sampling input). A batch that needs more (penalties, bias, sampling, top logprobs)
runs the sampler program on the gathered rows (``sample_program``), its sampling input packed
into one buffer too (``pack_sampling``); a step that verifies proposals, the verify program.

Every step's sampled tokens come back as one i32[rows, 2 + 2K] array (``pack_output``: token,
logprob bits, K top ids, K top logprob bits), copied to the host as soon as it is dispatched.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models.step_input import StepInput
from pagedjax.worker.input_batch import widest_seqs_bucket
from pagedjax.worker.sampler import SamplerOutput, SamplingInput, greedy, sample


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The static shape of a packed step (part of the step program's key)."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    num_logits: int  # logits rows the sampler reads (its rows gather from these)
    num_prompt_rows: int  # logits rows appended for prompt logprobs (0: none)
    max_query_len: int

    @property
    def sizes(self) -> tuple[int, ...]:
        t, s, logits = self.num_tokens, self.num_seqs, self.num_logits + self.num_prompt_rows
        # token ids, positions, slots, block tables, context lens, query starts, logits
        # indices, the sampler's logits rows
        return (t, t, t, s * self.max_blocks, s, s + 1, logits, self.num_logits)


def layout_of(step_input: StepInput, num_sampler_rows: int) -> StepLayout:
    num_seqs, max_blocks = np.shape(step_input.block_tables)
    num_logits = len(step_input.logits_indices)
    return StepLayout(
        len(step_input.token_ids),
        num_seqs,
        max_blocks,
        num_sampler_rows,
        num_logits - num_sampler_rows,
        step_input.max_query_len,
    )


def pack_inputs(step_input: StepInput, logit_rows: np.ndarray) -> tuple[np.ndarray, StepLayout]:
    """One i32 host buffer holding the step's inputs, and its layout. ``logit_rows``: the logits
    row each sampler row reads (as many as the step's sampler rows)."""
    layout = layout_of(step_input, len(logit_rows))
    parts = (
        step_input.token_ids,
        step_input.positions,
        step_input.slot_mapping,
        step_input.block_tables,
        step_input.context_lens,
        step_input.query_start_loc,
        step_input.logits_indices,
        logit_rows,
    )
    buf = np.concatenate([np.asarray(p, np.int32).reshape(-1) for p in parts])
    assert buf.size == sum(layout.sizes), (buf.size, layout)
    return buf, layout


def unpack_inputs(buf: jax.Array, layout: StepLayout) -> tuple[StepInput, jax.Array]:
    """``pack_inputs`` undone inside a program: (StepInput, logit_rows i32[num_logits])."""
    offsets = np.cumsum((0, *layout.sizes))
    ids, pos, slots, tables, ctx, qsl, indices, rows = (
        buf[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    )
    step = StepInput(
        token_ids=ids,
        positions=pos,
        slot_mapping=slots,
        block_tables=tables.reshape(layout.num_seqs, layout.max_blocks),
        context_lens=ctx,
        query_start_loc=qsl,
        logits_indices=indices,
        max_query_len=layout.max_query_len,
    )
    return step, rows


def fill_width(max_num_seqs: int) -> int:
    """W: the rows of every step's device tokens, the widest sequence bucket of an engine that
    runs at most ``max_num_seqs`` sequences a step (a decode step samples one row per slot; a
    step with more rows, n > 1 first samples, is never followed by a fill)."""
    return widest_seqs_bucket(max_num_seqs)


def fill_tokens(token_ids: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """token_ids i32[num_tokens] (-1 - r: row r of prev_tokens), prev_tokens i32[W]."""
    src = jnp.clip(-1 - token_ids, 0, prev_tokens.shape[0] - 1)
    return jnp.where(token_ids < 0, prev_tokens[src], token_ids)


def to_width(tokens: jax.Array, width: int) -> jax.Array:
    """i32[width]: ``tokens`` cut or padded with zeros (static shapes)."""
    n = tokens.shape[0]
    return tokens[:width] if n >= width else jnp.pad(tokens, (0, width - n))


def pack_output(out: SamplerOutput) -> jax.Array:
    """i32[rows, 2 + 2K]: token, logprob bits, top ids, top logprob bits (one array to fetch)."""
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    columns = (out.tokens[:, None], bits(out.logprobs)[:, None])
    return jnp.concatenate([*columns, out.top_token_ids, bits(out.top_logprobs)], axis=1)


def unpack_output(packed: np.ndarray) -> SamplerOutput:
    """``pack_output`` undone on the host (numpy)."""
    packed = np.asarray(packed, np.int32)
    k = (packed.shape[1] - 2) // 2
    return SamplerOutput(
        tokens=packed[:, 0],
        logprobs=packed[:, 1].view(np.float32),
        top_token_ids=packed[:, 2 : 2 + k],
        top_logprobs=np.ascontiguousarray(packed[:, 2 + k :]).view(np.float32),
    )


def after_model(
    logits: jax.Array, logit_rows: jax.Array, layout: StepLayout, prev_tokens: jax.Array
) -> dict:
    """The step program's outputs from the model's logits f32[num_logits + P, vocab]: the
    greedy sample packed, its tokens at width W, the sampler's rows of logits and the prompt
    rows' (P, for prompt logprobs)."""
    sample_logits = logits[logit_rows]  # [num_logits, vocab]
    out = greedy(sample_logits)
    return {
        "packed": pack_output(out),
        "tokens": to_width(out.tokens, prev_tokens.shape[0]),
        "logits": sample_logits,
        "prompt_logits": logits[layout.num_logits :],
    }


@dataclasses.dataclass(frozen=True)
class SamplingLayout:
    """The static shape of a packed ``SamplingInput``: its tree (static flags included) and
    each array's shape and dtype (all 32 bits wide)."""

    treedef: object
    leaves: tuple[tuple[tuple[int, ...], str], ...]


def pack_sampling(sampling: SamplingInput) -> tuple[np.ndarray, SamplingLayout]:
    """One i32 host buffer holding every array of ``sampling`` (floats as their bits)."""
    leaves, treedef = jax.tree.flatten(sampling)
    arrays = [np.ascontiguousarray(x) for x in leaves]
    assert all(a.dtype.itemsize == 4 for a in arrays), [a.dtype for a in arrays]
    layout = SamplingLayout(treedef, tuple((a.shape, a.dtype.name) for a in arrays))
    return np.concatenate([a.view(np.int32).reshape(-1) for a in arrays]), layout


def unpack_sampling(buf: jax.Array, layout: SamplingLayout) -> SamplingInput:
    """``pack_sampling`` undone inside a program."""
    leaves, start = [], 0
    for shape, dtype in layout.leaves:
        size = int(np.prod(shape))
        x = jax.lax.bitcast_convert_type(buf[start : start + size], jnp.dtype(dtype))
        leaves.append(x.reshape(shape))
        start += size
    return jax.tree.unflatten(layout.treedef, leaves)


def sample_program(logits: jax.Array, packed: jax.Array, layout: SamplingLayout, width: int):
    """The sampler program of a batch that needs more than greedy, its sampling input packed
    (``pack_sampling``): (packed output, tokens i32[W])."""
    out = sample(logits, unpack_sampling(packed, layout))
    return pack_output(out), to_width(out.tokens, width)


__all__ = [
    "StepLayout",
    "after_model",
    "fill_tokens",
    "fill_width",
    "pack_inputs",
    "pack_output",
    "pack_sampling",
    "sample_program",
    "unpack_inputs",
    "unpack_output",
    "unpack_sampling",
]
