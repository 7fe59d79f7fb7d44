"""Request: one prompt and how to decode it, with the sequences it runs (pure Python)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import numpy as np

from pagedjax.core.scheduler import SeqChunk
from pagedjax.core.sequence import Sequence, SequenceGroup
from pagedjax.outputs import RequestMetrics
from pagedjax.sampling_params import BeamSearchParams, SamplingParams
from pagedjax.structured_output.grammar import RequestGrammar
from pagedjax.structured_output.masks import advance_together
from pagedjax.structured_output.masks import mask_width as bitmask_width
from pagedjax.worker.prompt_logprobs import PromptLogprobs, PromptRows
from pagedjax.worker.sampler import SamplingRow

logger = logging.getLogger("pagedjax.engine.request")
GOLDEN = 0x9E3779B9  # spreads the per-sample seeds of one request
SAMPLING_EPS = 1e-5  # a temperature below this samples greedily (as vLLM)


@dataclasses.dataclass
class PreparedRequest:
    """A request tokenized, copied and checked, not yet queued (``LLMEngine.prepare_request``):
    its text (None: given as ids), prompt ids, own copy of the parameters, and its adapter
    (a LoRARequest, or None), its priority (served lowest first under the priority policy)."""

    text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    adapter: object = None
    priority: int = 0


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None  # the text, when the prompt came as one
    prompt_token_ids: list[int]
    group: SequenceGroup  # its sequences: one, then n samples or beam_width beams
    seed: int  # 32-bit; sample i draws with (seed + i * golden) mod 2**32
    error: str | None = None  # why the engine ended it, if it did (its output carries this)
    prompt_logprobs: PromptLogprobs | None = None  # set when its params ask for them
    grammar: RequestGrammar | None = None  # its structured output's state, if it has one
    # The EOS and stop token ids it cannot sample before params.min_tokens (set when > 0)
    min_tokens_stops: tuple[int, ...] = ()
    metrics: RequestMetrics = dataclasses.field(
        default_factory=lambda: RequestMetrics(time.monotonic()), repr=False, compare=False
    )
    # What its outputs carried so far, for RequestOutputKind.DELTA: seq id -> (output tokens,
    # characters of text), and whether its prompt logprobs went out
    sent: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict, repr=False)
    sent_prompt_logprobs: bool = dataclasses.field(default=False, repr=False)
    # seq id -> its generated logprobs as Logprobs, built so far (OutputProcessor._logprobs)
    sample_logprobs: dict[int, list] = dataclasses.field(default_factory=dict, repr=False)
    last_token_time: float | None = dataclasses.field(default=None, repr=False, compare=False)
    # (vocab size, the sampling row fields of its parameters): built on first use
    _row_cache: tuple[int, dict] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    # (vocab size, allowed_token_ids' bitmask, the min_tokens stops' complement): built on use
    _masks: tuple[int, np.ndarray | None, np.ndarray | None] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        so = getattr(self.params, "structured_outputs", None)
        if so is not None and self.grammar is None:
            if so.compiled is None:
                raise ValueError("structured_outputs was not compiled (InputProcessor.check)")
            self.grammar = RequestGrammar(so.compiled)
        k = getattr(self.params, "prompt_logprobs", None)
        if k is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs(self.prompt_token_ids, k)
            # A cached prefix has no logits: read no block but its own (see prompt_logprobs.py).
            for seq in self.group.get_seqs():
                seq.extra_hash_key = (seq.extra_hash_key, self.prompt_logprobs.cache_key)

    @property
    def params(self) -> SamplingParams | BeamSearchParams:
        """The request's own copy, stored once: in its group (the scheduler reads it there)."""
        return self.group.sampling_params

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def num_top_logprobs(self) -> int:
        """Most likely tokens its sampled rows need: its logprobs, or 2 * beam_width."""
        p = self.params
        return 2 * p.beam_width if self.is_beam_search else p.logprobs or 0

    def prompt_rows(self, chunk: SeqChunk) -> PromptRows | None:
        """The chunk's rows whose prompt logprobs are still to compute (None: none)."""
        if self.prompt_logprobs is None or self.prompt_logprobs.done:
            return None
        return self.prompt_logprobs.rows(chunk.seq.num_computed_tokens, chunk.num_tokens)

    def sampling_rows(self, chunk: SeqChunk, vocab_size: int) -> list[SamplingRow]:
        """The chunk's rows for the on-device sampler (one per token it samples)."""
        seq, num_samples = chunk.seq, chunk.num_samples
        if self.is_beam_search:
            return [SamplingRow(position=seq.get_len())] * num_samples
        if not num_samples:
            return []
        p, fields = self.params, self._row_fields(vocab_size)
        penalties = p.uses_penalties
        early = p.masks_early_stops and output_len_in_flight(seq) < p.min_tokens  # stops masked
        masked = early or self.grammar is not None or p.allowed_token_ids is not None
        if num_samples == 1 and not penalties and not masked:
            seed = (self.seed + seq.sample_index * GOLDEN) % 2**32
            return [SamplingRow(**fields, seed=seed, position=seq.get_len())]
        indices = range(num_samples) if num_samples > 1 else [seq.sample_index]
        return [
            SamplingRow(
                **fields,
                seed=(self.seed + i * GOLDEN) % 2**32,
                position=seq.get_len(),
                prompt_token_ids=seq.prompt_token_ids if penalties else (),
                output_token_ids=seq.output_token_ids if penalties else (),
                token_bitmask=self._allowed(seq, vocab_size, early),
            )
            for i in indices
        ]

    def _allowed(self, seq: Sequence, vocab_size: int, early: bool) -> np.ndarray | None:
        """The tokens seq may sample next (a bitmask; None: any): its grammar's and its
        allowed_token_ids, less the stop tokens while it is short of min_tokens. Where only
        stop tokens would be left, they stay (a grammar must be able to end)."""
        if self._masks is None or self._masks[0] != vocab_size:
            ids, stops = self.params.allowed_token_ids, self.min_tokens_stops
            only = None if ids is None else token_bitmask(ids, vocab_size)
            self._masks = (vocab_size, only, token_bitmask(stops, vocab_size, allow=False))
        _, only, not_stops = self._masks
        mask = only
        if self.grammar is not None:
            grammar = self.grammar.mask(seq)
            mask = grammar if mask is None else grammar & mask
            if only is not None and not mask.any():  # it would sample what nothing allows
                kind = self.params.structured_outputs.kind
                raise ValueError(
                    f"allowed_token_ids and structured_outputs.{kind} have no token in common "
                    f"after {seq.get_output_len()} output tokens: the request ends with none"
                )
        if early and self.min_tokens_stops:
            if mask is None:
                return not_stops
            if (mask & not_stops).any():
                return mask & not_stops
        return mask

    def got_tokens(self, now: float) -> float | None:
        """Its sequences got tokens in a step that finished at ``now``: the seconds since its
        tokens before (vLLM's inter-token latency), None for its first."""
        gap = None if self.last_token_time is None else now - self.last_token_time
        self.last_token_time = now
        if self.metrics.first_token_time is None:
            scheduled = self.group.first_scheduled_time
            self.metrics = RequestMetrics(self.metrics.arrival_time, now, scheduled)
        return gap

    def _row_fields(self, vocab_size: int) -> dict:
        """The sampling row fields that come from the request's parameters alone (built once:
        the parameters do not change while it runs)."""
        if self._row_cache is not None and self._row_cache[0] == vocab_size:
            return self._row_cache[1]
        fields = row_fields(self.params, vocab_size)
        self._row_cache = (vocab_size, fields)
        return fields


def output_len_in_flight(seq: Sequence) -> int:
    """The output tokens ``seq`` has before the token its next row samples: its own, and the
    placeholder of a step still in flight (core/in_flight.py puts it in ``token_ids`` only)."""
    return seq.get_len() - seq.get_prompt_len()


def row_fields(p: SamplingParams, vocab_size: int) -> dict:
    """The SamplingRow fields that ``p`` alone sets."""
    return dict(
        temperature=float(p.temperature) if p.temperature >= SAMPLING_EPS else 0.0,
        top_k=min(max(p.top_k, 0), vocab_size),
        top_p=float(p.top_p),
        min_p=float(p.min_p),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        repetition_penalty=float(p.repetition_penalty),
        logit_bias=tuple((p.logit_bias or {}).items()),
    )


def token_bitmask(token_ids, vocab_size: int, allow: bool = True) -> np.ndarray:
    """The sampler's allowed-token bitmask (i32 words, bit t of word t // 32: token t) allowing
    just ``token_ids``, or (``allow`` False) every token of the vocabulary but them."""
    width = bitmask_width(vocab_size)
    bits = np.full(width * 32, not allow, np.uint32)
    bits[vocab_size:] = 0
    bits[[t for t in token_ids if t < vocab_size]] = allow
    words = (bits.reshape(width, 32) << np.arange(32, dtype=np.uint32)).sum(1, dtype=np.uint32)
    return words.view(np.int32)


def advance_grammars(pairs: Iterable[tuple[Request, Sequence]]) -> None:
    """Before a step's stops are checked: every constrained sequence of ``pairs`` takes its new
    tokens and computes its next mask, all together (structured_output/masks.py). Should that
    fail, their matchers are rebuilt from the tokens by ``after_token``, one sequence at a time,
    where an error is its own request's."""
    todo = []
    for req, seq in pairs:
        try:
            if req.grammar is not None and req.error is None and not seq.is_finished():
                todo.append((req.grammar, seq))
        except Exception:  # raised again by its own stop check, which fails its request alone
            continue
    try:
        advance_together(todo)
    except Exception:
        logger.exception("grammar masks computed together failed; computing them one by one")
        for grammar, seq in todo:
            grammar.forget(seq)
