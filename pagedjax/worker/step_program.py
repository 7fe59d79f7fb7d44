"""One program per step: what the runner's step program does around the model, and its packing.

A step's host inputs (the ``StepInput`` arrays and the sampler's logits rows, all int32, and in a
sampled decode step the sampler's input, floats as their bits) travel as ONE buffer, one transfer
(``pack_inputs``); the program slices them back out at offsets its static ``StepLayout`` fixes.
Inside the same program, before the model, placeholder tokens take the previous step's sampled
tokens (async scheduling: id ``-1 - r``, core/in_flight.py's ``placeholder(r)``, is row r of
``prev_tokens``, an i32[W] array still on the device; W = ``fill_width``, every step's tokens are
widened or cut to it, so there is no program per pair of widths); after the model, the sampler's
logits rows are gathered and sampled there too: a plain greedy batch by ``sampler.greedy``
(argmax and logprobs, no sampling input), a decode step that needs more (sampling, top logprobs)
by ``sampler.sample`` on the sampling input packed with the step's (``samples_in_step``: its
variant is part of the layout, so such a step is one program too). A prefill step that needs
more, and a batch with penalties, logit bias or an allowed-token mask, run the sampler program
on the gathered rows (``sample_program``), its sampling input packed into one buffer too
(``pack_sampling``); a step that verifies proposals, the verify program. Every step program also
returns the last layer's output of each token row (``hidden``), from which a step whose chunks
score prompt rows (prompt logprobs, worker/prompt_logprobs.py) scores them with programs of its
own, so that no model program exists per count of such rows.

Every step's sampled tokens come back as one i32[rows, 2 + 2K] array (``pack_output``: token,
logprob bits, K top ids, K top logprob bits), copied to the host as soon as it is dispatched.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models.step_input import StepInput
from pagedjax.worker.input_batch import widest_seqs_bucket
from pagedjax.worker.sampler import (
    MODES,
    SamplerOutput,
    SamplingInput,
    Variant,
    greedy,
    sample,
)

# StepInput's arrays, in field order: the packed buffer holds them in this order (a field added
# to StepInput, an i32 array, is packed with no change here; one that is None, e.g. ``lora_slot``
# without LoRA, takes no words and is None again inside the program).
ARRAY_FIELDS = tuple(
    f.name for f in dataclasses.fields(StepInput) if f.metadata.get("pytree_node", True)
)


@dataclasses.dataclass(frozen=True)
class SamplingLayout:
    """The static shape of a packed ``SamplingInput``: its tree (static flags included) and
    each array's shape and dtype (all 32 bits wide)."""

    treedef: object
    leaves: tuple[tuple[tuple[int, ...], str], ...]


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The static shape of a packed step (part of the step program's key)."""

    # each of StepInput's arrays (ARRAY_FIELDS order); None for a field that is None
    shapes: tuple[tuple[int, ...] | None, ...]
    num_logits: int  # logits rows the sampler reads (its rows gather from these)
    max_query_len: int
    # The sampler's input, packed after the step's (a sampled decode step: the step program
    # samples it); None: the program samples greedily.
    sampling: SamplingLayout | None = None

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.shapes[ARRAY_FIELDS.index(name)]

    @property
    def num_tokens(self) -> int:
        return self.shape_of("token_ids")[0]

    @property
    def num_seqs(self) -> int:
        return self.shape_of("context_lens")[0]

    @property
    def max_blocks(self) -> int:
        return self.shape_of("block_tables")[1]

    @property
    def sizes(self) -> tuple[int, ...]:
        """i32 words of each part: StepInput's arrays, the sampler's logits rows, the sampling
        input (0 without one)."""
        sampling = (
            sum(math.prod(shape) for shape, _ in self.sampling.leaves) if self.sampling else 0
        )
        arrays = (0 if shape is None else math.prod(shape) for shape in self.shapes)
        return (*arrays, self.num_logits, sampling)


def pack_inputs(
    step_input: StepInput,
    logit_rows: np.ndarray,
    sampling: SamplingInput | None = None,
) -> tuple[np.ndarray, StepLayout]:
    """One i32 host buffer holding the step's inputs, and its layout. ``logit_rows``: the logits
    row each sampler row reads (as many as the step's sampler rows); ``sampling``: the sampler's
    input when the step program samples a batch that needs more than greedy."""
    values = [getattr(step_input, name) for name in ARRAY_FIELDS]
    arrays = [np.asarray(x) for x in values if x is not None]
    for name, x in zip(ARRAY_FIELDS, values, strict=True):
        if x is not None and x.dtype != np.int32:
            raise ValueError(f"StepInput.{name} must be int32 to be packed, got {x.dtype}")
    parts = [x.ravel() for x in arrays]
    parts.append(np.asarray(logit_rows, np.int32))
    sampling_layout = None
    if sampling is not None:
        sampling_parts, sampling_layout = _sampling_parts(sampling)
        parts += sampling_parts
    layout = StepLayout(
        tuple(None if x is None else np.shape(x) for x in values),
        len(logit_rows),
        step_input.max_query_len,
        sampling_layout,
    )
    return np.concatenate(parts), layout


def unpack_inputs(buf: jax.Array, layout: StepLayout):
    """``pack_inputs`` undone inside a program: (StepInput, logit_rows i32[num_logits],
    SamplingInput or None)."""
    offsets = np.cumsum((0, *layout.sizes))
    parts = [buf[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    arrays = {
        name: None if shape is None else part.reshape(shape)
        for name, part, shape in zip(ARRAY_FIELDS, parts, layout.shapes, strict=False)
    }
    step = StepInput(**arrays, max_query_len=layout.max_query_len)
    rows = parts[len(ARRAY_FIELDS)]
    sampling = unpack_sampling(parts[-1], layout.sampling) if layout.sampling else None
    return step, rows, sampling


def samples_in_step(variant: Variant) -> bool:
    """Whether a decode step whose batch needs this sampler variant samples inside the step
    program (one program, one transfer): every variant but those with penalties or a logit bias
    or allowed-token mask, whose token histories and bitmasks keep their own sampler program
    (a step program per decode shape and variant is compiled, so the rare ones stay apart)."""
    return not variant.penalties and not variant.constrained


def step_variants() -> list[Variant]:
    """The sampler variants a decode step program can hold besides plain greedy: one per mode
    (greedy with top logprobs, sampling, sampling with top-k or top-p)."""
    return [Variant(False, False, random, filters) for random, filters in MODES]


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
    logits: jax.Array,
    logit_rows: jax.Array,
    prev_tokens: jax.Array,
    sampling: SamplingInput | None = None,
) -> dict:
    """The step program's outputs from the model's logits f32[num_logits, vocab]: the sample
    packed (greedy, or by ``sampling``), its tokens at width W and the sampler's rows of
    logits."""
    sample_logits = logits[logit_rows]  # [num_logits, vocab]
    out = greedy(sample_logits) if sampling is None else sample(sample_logits, sampling)
    return {
        "packed": pack_output(out),
        "tokens": to_width(out.tokens, prev_tokens.shape[0]),
        "logits": sample_logits,
    }


def _sampling_parts(sampling: SamplingInput) -> tuple[list[np.ndarray], SamplingLayout]:
    leaves, treedef = jax.tree.flatten(sampling)
    arrays = [np.ascontiguousarray(x) for x in leaves]
    assert all(a.dtype.itemsize == 4 for a in arrays), [a.dtype for a in arrays]
    layout = SamplingLayout(treedef, tuple((a.shape, a.dtype.name) for a in arrays))
    return [a.view(np.int32).reshape(-1) for a in arrays], layout


def pack_sampling(sampling: SamplingInput) -> tuple[np.ndarray, SamplingLayout]:
    """One i32 host buffer holding every array of ``sampling`` (floats as their bits)."""
    parts, layout = _sampling_parts(sampling)
    return np.concatenate(parts), layout


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
    "ARRAY_FIELDS",
    "SamplingLayout",
    "StepLayout",
    "after_model",
    "fill_tokens",
    "fill_width",
    "pack_inputs",
    "pack_output",
    "pack_sampling",
    "sample_program",
    "samples_in_step",
    "step_variants",
    "unpack_inputs",
    "unpack_output",
    "unpack_sampling",
]
