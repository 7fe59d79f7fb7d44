"""A batch's sampling input, built on the host from its rows (worker/sampler.py samples it).

``SamplingRow`` is one row's settings; ``SamplingInput.build`` packs rows into numpy arrays whose
shapes the row count alone sets (plus one token-history width when some row uses penalties, and
one bias width and bitmask width when the batch is constrained). Sampling is data: temperature,
seeds, min-p, top-k, top-p, penalties' strengths, biases and masks are arrays, and top logprobs
are always computed at one width. What a batch needs is decided here as a few static fields
(``Variant``), each of which keeps a large cost off the batches that do not need it: whether some
row has a penalty (the token history), whether the batch is constrained (bias and bitmask
columns), whether some row samples (the random draw), and whether some sampling row has top-k or
top-p past the candidates (the full sort: ``Filters``). ``MODES`` and ``variants`` list the few
programs this makes: the sampler never multiplies the model's programs by more than three.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import jax
import numpy as np
from flax import struct

from pagedjax.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from pagedjax.structured_output.masks import mask_width as bitmask_width
from pagedjax.utils import next_pow2

NUM_CANDIDATES = 256  # logits per row that top-k / top-p look at before falling back to a sort
_MIN_TOKENS_BUCKET = 16  # narrowest token-history array when no fixed width is given
# Top logprobs are computed at one fixed width (whatever a request asks, up to vLLM's cap), so the
# number a request asks for never makes a new program.
TOP_LOGPROBS_WIDTH = MAX_LOGPROBS


@dataclasses.dataclass
class SamplingRow:
    """One sequence's sampling settings for one step (host side)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # <= 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int = 0
    position: int = 0  # position of the token being sampled
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, added to its logit)
    token_bitmask: np.ndarray | None = None  # i32[ceil(vocab / 32)], bit t: token t allowed


class Filters(enum.IntEnum):
    """How much of the top-k / top-p machinery a batch's rows need (static)."""

    MIN_P = 0  # no row samples: min-p's threshold alone (greedy rows keep their argmax anyway)
    # No row has top-p or a top-k past the candidates: the candidates decide every row's
    # threshold (its top-k among them; min-p alone without one), no sort. Sampling rows with no
    # filter but temperature and min-p take it too: the candidates cost little beside the draw.
    CANDIDATES = 1
    # Some row has top-p, or a top-k past the candidates: the candidates decide each row's
    # threshold where they can (a top-k within them, a nucleus that closes inside them), the full
    # sort elsewhere.
    SORT = 2


def filters_needed(rows: Sequence[SamplingRow], vocab_size: int) -> Filters:
    """The least filtering that gives every row of a sampling batch its exact threshold."""
    for r in rows:
        if r.top_p < 1 or NUM_CANDIDATES < r.top_k < vocab_size:
            return Filters.SORT
    return Filters.CANDIDATES


def _bucket(n: int) -> int:
    return next_pow2(n, _MIN_TOKENS_BUCKET)


@struct.dataclass
class SamplingInput:
    temperature: jax.Array  # f32[num_seqs], 0 = greedy
    top_k: jax.Array  # i32[num_seqs], <= 0 = off
    top_p: jax.Array  # f32[num_seqs], 1 = off
    min_p: jax.Array  # f32[num_seqs], 0 = off
    seeds: jax.Array  # u32[num_seqs]
    positions: jax.Array  # i32[num_seqs], position of the token being sampled
    presence_penalty: jax.Array  # f32[num_seqs], 0 = off
    frequency_penalty: jax.Array  # f32[num_seqs], 0 = off
    repetition_penalty: jax.Array  # f32[num_seqs], 1 = off
    # The tokens penalties read: row i's first prompt_lens[i] entries are prompt tokens, the rest
    # output tokens; padded with vocab_size. One column wide when no row uses penalties.
    token_history: jax.Array  # i32[num_seqs, W]
    prompt_lens: jax.Array  # i32[num_seqs]
    # Logit bias and allowed tokens: MAX_LOGIT_BIAS and ceil(vocab / 32) columns in a
    # constrained batch (bias ids padded with vocab_size, masks with -1: all allowed), else 0.
    bias_ids: jax.Array  # i32[num_seqs, B]
    bias_values: jax.Array  # f32[num_seqs, B]
    token_bitmask: jax.Array  # i32[num_seqs, W], packed: bit t % 32 of word t // 32 = token t
    # Static, so part of the program (see the module doc): some row has a penalty; some row
    # samples (temperature > 0); the filtering the sampling rows need. A greedy batch runs the
    # argmax alone: on a CPU the random draw over the [num_seqs, vocab] logits costs about
    # twenty times the argmax (benchmarks/sampler_cpu.py).
    penalties: bool = struct.field(pytree_node=False, default=True)
    random: bool = struct.field(pytree_node=False, default=True)
    filters: Filters = struct.field(pytree_node=False, default=Filters.SORT)

    @property
    def variant(self) -> Variant:
        constrained = self.token_bitmask.shape[1] > 0
        return Variant(self.penalties, constrained, self.random, self.filters)

    def without_flags(self) -> SamplingInput:
        """The same rows with the static flags at their general values, for a program that reads
        none of them (the draft model's sampler), so that they never compile it twice."""
        return self.replace(penalties=True, random=True, filters=Filters.SORT)

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        size: int,
        vocab_size: int,
        *,
        history_width: int | None = None,
        constrained: bool = False,
    ) -> SamplingInput:
        """Pack ``rows`` (numpy), padded to ``size`` rows with greedy no-op rows. The batch is
        constrained (bias and bitmask columns) when ``constrained`` or some row has a logit bias
        or an allowed-token mask.

        The token history holds only the rows whose penalties read it (a row's prompt only when
        it has a repetition penalty); a row whose penalties are all neutral gets padding. It is
        ``history_width`` columns wide when some row uses penalties (the runner passes its
        max_model_len, so the width never makes a new program), one column otherwise; without a
        ``history_width``, the longest row's length bucketed (a power of two, at least 16).
        """
        if len(rows) > size:
            raise ValueError(f"size must be >= the number of rows ({len(rows)}), got {size}")
        pad = size - len(rows)

        def col(name, dtype, fill):
            return np.asarray([getattr(r, name) for r in rows] + [fill] * pad, dtype=dtype)

        history, prompt_lens = _token_history(rows, size, vocab_size, history_width)
        constrained = constrained or any(r.logit_bias or r.token_bitmask is not None for r in rows)
        bias_ids, bias_values, bitmask = _constraints(rows, size, vocab_size, constrained)
        random = any(r.temperature > 0 for r in rows)
        return cls(
            temperature=col("temperature", np.float32, 0.0),
            top_k=col("top_k", np.int32, 0),
            top_p=col("top_p", np.float32, 1.0),
            min_p=col("min_p", np.float32, 0.0),
            seeds=col("seed", np.uint32, 0),
            positions=col("position", np.int32, 0),
            presence_penalty=col("presence_penalty", np.float32, 0.0),
            frequency_penalty=col("frequency_penalty", np.float32, 0.0),
            repetition_penalty=col("repetition_penalty", np.float32, 1.0),
            token_history=history,
            prompt_lens=prompt_lens,
            bias_ids=bias_ids,
            bias_values=bias_values,
            token_bitmask=bitmask,
            penalties=any(_reads_history(r) for r in rows),
            random=random,
            # Greedy rows are never filtered: a batch without a sampling row needs no filter.
            filters=filters_needed(rows, vocab_size) if random else Filters.MIN_P,
        )


def _checked_ids(name: str, i: int, ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} must be in [0, {vocab_size}), got row {i}: {ids}")
    return ids


def _reads_history(row: SamplingRow) -> bool:
    """Whether a row's penalties read its token history."""
    return row.repetition_penalty != 1 or row.presence_penalty != 0 or row.frequency_penalty != 0


def _token_history(rows, size: int, vocab_size: int, history_width: int | None):
    """(token_history i32[size, width] padded with vocab_size, prompt_lens i32[size]) of the rows
    whose penalties read them (see ``SamplingInput.build``)."""
    histories = []  # (row, prompt tokens, output tokens) of the rows penalties read
    for i, r in enumerate(rows):
        if _reads_history(r):
            repeats = r.repetition_penalty != 1
            prompt = _checked_ids(
                "prompt_token_ids", i, r.prompt_token_ids if repeats else (), vocab_size
            )
            output = _checked_ids("output_token_ids", i, r.output_token_ids, vocab_size)
            histories.append((i, prompt, output))
    longest = max((p.size + o.size for _, p, o in histories), default=0)
    if not histories:
        width = 1
    elif history_width is None:
        width = _bucket(longest)
    elif longest > history_width:
        raise ValueError(
            f"a row's prompt and output tokens ({longest}) exceed history_width={history_width}"
        )
    else:
        width = history_width
    history = np.full((size, width), vocab_size, np.int32)
    prompt_lens = np.zeros(size, np.int32)
    for i, prompt, output in histories:
        history[i, : prompt.size] = prompt
        history[i, prompt.size : prompt.size + output.size] = output
        prompt_lens[i] = prompt.size
    return history, prompt_lens


def _constraints(rows, size: int, vocab_size: int, constrained: bool):
    """(bias_ids i32[size, B], bias_values f32[size, B], token_bitmask i32[size, M]): B and M
    zero unless ``constrained``."""
    bias_width = MAX_LOGIT_BIAS if constrained else 0
    bias_ids = np.full((size, bias_width), vocab_size, np.int32)
    bias_values = np.zeros((size, bias_width), np.float32)
    bitmask = np.full((size, bitmask_width(vocab_size) if constrained else 0), -1, np.int32)
    for i, r in enumerate(rows):
        if len(r.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"row {i}: at most {MAX_LOGIT_BIAS} logit biases")
        if r.logit_bias:
            ids, values = zip(*r.logit_bias, strict=True)
            bias_ids[i, : len(ids)] = _checked_ids("logit_bias", i, ids, vocab_size)
            bias_values[i, : len(ids)] = values
        if r.token_bitmask is not None:
            bitmask[i] = r.token_bitmask
    return bias_ids, bias_values, bitmask


@dataclasses.dataclass(frozen=True)
class Variant:
    """The static part of a ``SamplingInput``: which sampler program a batch runs."""

    penalties: bool = False
    constrained: bool = False  # bias and bitmask columns (some row may have either)
    random: bool = False
    filters: Filters | None = None  # None: the least a batch of this kind takes (MODES)

    def __post_init__(self):
        least = Filters.CANDIDATES if self.random else Filters.MIN_P
        filters = least if self.filters is None else Filters(self.filters)
        if (self.random, filters) not in MODES:
            raise ValueError(f"no sampler program samples {self.random=} with {filters!r}")
        object.__setattr__(self, "filters", filters)

    def __str__(self) -> str:
        # Not ``constrained``: every sampler program's input is, no step program's is.
        words = ["penalties"] if self.penalties else []
        words.append(f"sampling {self.filters.name.lower()}" if self.random else "greedy")
        return " ".join(words)

    def row(self) -> SamplingRow:
        """A row whose batch runs this variant's program (warm-up)."""
        return SamplingRow(
            temperature=1.0 if self.random else 0.0,
            top_k=50 if self.filters == Filters.CANDIDATES else 0,
            top_p=0.5 if self.filters == Filters.SORT else 1.0,
            repetition_penalty=1.5 if self.penalties else 1.0,
            logit_bias=((0, 1.0),) if self.constrained else (),
        )


# (random, filters) of the batches a sampler runs: greedy with top logprobs, sampling with
# temperature, min-p and a top-k within the candidates, sampling with top-p (or a wider top-k).
MODES = ((False, Filters.MIN_P), (True, Filters.CANDIDATES), (True, Filters.SORT))


def plain_greedy(rows: Sequence[SamplingRow], num_top_logprobs: int = 0) -> bool:
    """Whether the batch needs no sampling input at all: no row samples or has a penalty, bias
    or mask, and no top logprobs (the step program takes its argmax itself)."""
    return num_top_logprobs == 0 and all(
        r.temperature <= 0 and not needs_own_program(r) for r in rows
    )


def needs_own_program(row: SamplingRow) -> bool:
    """Whether the row's batch needs the sampler program of its own (after the model step): a
    penalty (its token history) or a logit bias or allowed-token mask (their columns)."""
    return _reads_history(row) or bool(row.logit_bias) or row.token_bitmask is not None


def variants() -> list[Variant]:
    """The sampler programs' variants (for each row count): with or without penalties, always
    constrained (the columns are cheap beside a program of its own), in each of the ``MODES``."""
    return [
        Variant(penalties, True, random, filters)
        for penalties in (False, True)
        for random, filters in MODES
    ]
