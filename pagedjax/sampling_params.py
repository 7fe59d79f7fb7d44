"""SamplingParams and BeamSearchParams: how one request is decoded (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
import enum
import math

from pagedjax.structured_output.grammar import StructuredOutputsParams

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # entries of logit_bias (the sampler's fixed-width bias input)
MAX_BIAS_VALUE = 100.0  # |bias| at most this, as OpenAI's API
MAX_INT32 = 2**31 - 1  # what the on-device sampler's integer fields hold
MIN_REPETITION_PENALTY = 0.01  # below this, dividing logits by it can overflow to inf
MAX_REPETITION_PENALTY = 100.0


def _bad(obj, name: str, why: str):
    raise ValueError(f"{name} {why}, got {getattr(obj, name)!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]


class RequestOutputKind(enum.Enum):
    """What the engine returns for a request at each step (vLLM's)."""

    CUMULATIVE = 0  # everything so far, at every step it ran in
    DELTA = 1  # only what is new since its last output (text, token ids, logprobs)
    FINAL_ONLY = 2  # nothing until it finishes, then everything


def _check_output_kind(obj, kinds=tuple(RequestOutputKind)) -> None:
    if not isinstance(obj.output_kind, RequestOutputKind) or obj.output_kind not in kinds:
        names = ", ".join(f"RequestOutputKind.{k.name}" for k in kinds)
        _bad(obj, "output_kind", f"must be one of {names}")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1  # independent samples of the same prompt, sharing its KV blocks
    # vLLM V0's: run this many samples and return the n of highest cumulative logprob (None: n)
    best_of: int | None = None
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # <= 0 (or -1, vLLM's spelling) = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # in [0, 2**64): same tokens whatever shares its batch
    stop: str | list[str] | None = None  # stop strings, not included in the output text
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: no EOS or stop token id can be sampled, and no stop string ends the output, before
    # this many tokens
    min_tokens: int = 0
    logprobs: int | None = None  # also return this many most likely tokens per position
    # Score the prompt too: each prompt token's logprob (None for the first) and the top k. Such
    # a request computes its whole prompt (it does not read the shared prefix cache).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these can be sampled
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (structured_output.py)
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    # vLLM's: the stop string, EOS or stop token id that ended the text stays in it
    include_stop_str_in_output: bool = False
    # vLLM's: only the prompt's last k tokens are run (-1: the last max_model_len)
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if not _is_int(self.n) or not 1 <= self.n <= MAX_INT32:
            _bad(self, "n", "must be an integer >= 1")
        if self.best_of is not None and (
            not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_INT32
        ):
            _bad(self, "best_of", f"must be None or an integer >= n={self.n}")
        streamed = self.output_kind is RequestOutputKind.DELTA
        if streamed and self.best_of is not None and self.best_of > self.n:
            _bad(self, "best_of", "greater than n cannot be streamed (output_kind DELTA)")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            _bad(self, "max_tokens", f"must be an integer in [1, {MAX_INT32}]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _bad(self, "min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            _bad(self, "temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            _bad(self, "top_k", f"must be an integer in [-1, {MAX_INT32}] (-1 or 0 disables it)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _bad(self, "top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _bad(self, "min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                _bad(self, name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not (
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            _bad(
                self,
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]",
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            _bad(self, "seed", "must be an integer in [0, 2**64)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            _bad(self, "stop", "must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            _bad(self, "stop_token_ids", "must be non-negative integers (token ids)")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            _bad(self, "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            _bad(self, "prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                _bad(self, "logit_bias", f"must be a dict of at most {MAX_LOGIT_BIAS} entries")
            for t, v in self.logit_bias.items():
                if not _is_int(t) or not 0 <= t <= MAX_INT32:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
                if not _is_number(v) or not -MAX_BIAS_VALUE <= v <= MAX_BIAS_VALUE:
                    raise ValueError(
                        f"logit_bias values must be in [-100, 100], got {v!r} for token {t}"
                    )
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= MAX_INT32)):
            _bad(self, "truncate_prompt_tokens", "must be None, -1 or an integer >= 1")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (
                not isinstance(ids, list | tuple)
                or not ids
                or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in ids)
            ):
                _bad(self, "allowed_token_ids", "must be None or a non-empty list of token ids")
            self.allowed_token_ids = list(ids)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            _bad(self, "structured_outputs", "must be None or StructuredOutputsParams")
        _check_output_kind(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def max_num_seqs(self) -> int:
        """Sequences this request runs at once (the scheduler's admission count)."""
        return self.best_of or self.n

    @property
    def stop_hold(self) -> int:
        """Characters at the end of a running text that a stop string found at a later token
        could still cut (one less than the longest stop string; 0 without): a stream holds
        them back."""
        return max((len(s) for s in self.stop), default=1) - 1

    @property
    def masks_early_stops(self) -> bool:
        """Whether min_tokens masks any token: EOS (unless ignored) or a stop token id. (vLLM's
        benchmark clients send min_tokens with ignore_eos: nothing to mask, nothing to pay.)"""
        return self.min_tokens > 0 and (not self.ignore_eos or bool(self.stop_token_ids))

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


@dataclasses.dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0  # score = cumulative logprob / output_length ** length_penalty
    # Beams are ranked anew at every step, so their outputs come whole (no DELTA)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            _bad(self, "beam_width", f"must be an integer in [1, {MAX_LOGPROBS // 2}]")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            _bad(self, "max_tokens", f"must be an integer in [1, {MAX_INT32}]")
        if not _is_number(self.length_penalty):
            _bad(self, "length_penalty", "must be a finite number")
        _check_output_kind(self, (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY))

    @property
    def max_num_seqs(self) -> int:
        return self.beam_width


def _is_number(x) -> bool:
    """A finite int or float (not a bool; not inf or NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False
