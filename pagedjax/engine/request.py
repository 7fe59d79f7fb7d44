"""Request: one prompt and how to decode it, with the sequences it runs (pure Python)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from pagedjax.core.scheduler import SeqChunk
from pagedjax.core.sequence import Sequence, SequenceGroup
from pagedjax.outputs import RequestMetrics
from pagedjax.sampling_params import BeamSearchParams, SamplingParams
from pagedjax.structured_output.grammar import RequestGrammar
from pagedjax.structured_output.masks import advance_together
from pagedjax.worker.prompt_logprobs import PromptLogprobs, PromptRows
from pagedjax.worker.sampler import SamplingRow

logger = logging.getLogger("pagedjax.engine.request")
GOLDEN = 0x9E3779B9  # spreads the per-sample seeds of one request
SAMPLING_EPS = 1e-5  # a temperature below this samples greedily (as vLLM)


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
    metrics: RequestMetrics = dataclasses.field(
        default_factory=lambda: RequestMetrics(time.monotonic()), repr=False, compare=False
    )
    # What its outputs carried so far, for RequestOutputKind.DELTA: seq id -> (output tokens,
    # characters of text), and whether its prompt logprobs went out
    sent: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict, repr=False)
    sent_prompt_logprobs: bool = dataclasses.field(default=False, repr=False)
    # (vocab size, the sampling row fields of its parameters): built on first use
    _row_cache: tuple[int, dict] | None = dataclasses.field(
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
        fields = self._row_fields(vocab_size)
        penalties = self.params.uses_penalties
        if num_samples == 1 and not penalties and self.grammar is None:  # most decode rows
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
                token_bitmask=self.grammar.mask(seq) if self.grammar is not None else None,
            )
            for i in indices
        ]

    def got_tokens(self, now: float) -> None:
        """Its sequences got tokens in a step that finished at ``now``."""
        if self.metrics.first_token_time is None:
            self.metrics = RequestMetrics(self.metrics.arrival_time, now)

    def _row_fields(self, vocab_size: int) -> dict:
        """The sampling row fields that come from the request's parameters alone (built once:
        the parameters do not change while it runs)."""
        if self._row_cache is not None and self._row_cache[0] == vocab_size:
            return self._row_cache[1]
        p = self.params
        fields = dict(
            temperature=float(p.temperature) if p.temperature >= SAMPLING_EPS else 0.0,
            top_k=min(max(p.top_k, 0), vocab_size),
            top_p=float(p.top_p),
            min_p=float(p.min_p),
            presence_penalty=float(p.presence_penalty),
            frequency_penalty=float(p.frequency_penalty),
            repetition_penalty=float(p.repetition_penalty),
            logit_bias=tuple((p.logit_bias or {}).items()),
        )
        self._row_cache = (vocab_size, fields)
        return fields


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
