"""A request's outputs across the engine process's pipe as deltas (vLLM V1 sends an engine core's
outputs as new tokens, not whole sequences): the engine returns a request's whole RequestOutput
at every step, which crossing the pipe whole would pickle and unpickle its token ids, logprobs and
prompt logprobs again at every token (quadratic in the output's length, and a collector's pass
over every object on the API side). ``OutputEncoder`` (one per request, in the engine process)
sends the first output whole and then only what changed; ``OutputDecoder`` (one per request, in
the API process) rebuilds each RequestOutput equal to the engine's.

What a delta may leave out rests on how the engine builds an output: a completion's token ids and
logprobs only grow while its earlier tokens stay (a logprob is fixed when its token is sampled),
its text grows or is cut at a stop string, the prompt never changes and the prompt logprobs are
built once (the same list from then on). Whatever breaks that (another number of completions,
token ids that are not an extension, a text that does not extend the last one) is sent whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pagedjax.outputs import CompletionOutput, PromptLogprobsList, RequestMetrics, RequestOutput


@dataclasses.dataclass
class CompletionDelta:
    """One completion's change: its text, token ids and logprobs are the last ones' first
    ``*_kept`` entries followed by the new ones."""

    index: int
    text_kept: int
    text_new: str
    tokens_kept: int
    tokens_new: list[int]
    logprobs_kept: int  # -1: logprobs_new is the whole list (or None)
    logprobs_new: list
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclasses.dataclass
class OutputDelta:
    """A RequestOutput after the first, as the change from the one before it."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    error: str | None
    prompt_logprobs: PromptLogprobsList | None  # None: the same as before
    spec_decoding: object
    metrics: RequestMetrics | None = None  # None: the same as before


class OutputEncoder:
    """The engine process's side: each output of one request, whole the first time (or when a
    delta cannot describe it), as an OutputDelta afterwards."""

    def __init__(self):
        self._last: RequestOutput | None = None

    def encode(self, out: RequestOutput) -> RequestOutput | OutputDelta:
        last, self._last = self._last, out
        if last is None or len(out.outputs) != len(last.outputs):
            return out
        completions = []
        for new, old in zip(out.outputs, last.outputs, strict=True):
            delta = _completion_delta(new, old)
            if delta is None:
                return out
            completions.append(delta)
        same_prompt_logprobs = out.prompt_logprobs is last.prompt_logprobs
        return OutputDelta(
            out.request_id,
            completions,
            out.finished,
            out.error,
            None if same_prompt_logprobs else out.prompt_logprobs,
            out.spec_decoding,
            None if out.metrics is last.metrics else out.metrics,
        )


def _completion_delta(new: CompletionOutput, old: CompletionOutput) -> CompletionDelta | None:
    """new as a change of old, or None when new does not extend old's tokens."""
    kept = len(old.token_ids)
    if new.index != old.index or new.token_ids[:kept] != old.token_ids:
        return None
    text_kept = len(old.text) if new.text.startswith(old.text) else 0
    lp_kept, lp_new = -1, new.logprobs  # sent whole (or None)
    if new.logprobs is not None and old.logprobs is not None:
        n = len(old.logprobs)  # a sequence's logprobs list only grows: its nth entry is old's last
        if n <= len(new.logprobs) and (n == 0 or new.logprobs[n - 1] is old.logprobs[n - 1]):
            lp_kept, lp_new = n, new.logprobs[n:]
    return CompletionDelta(
        new.index,
        text_kept,
        new.text[text_kept:],
        kept,
        new.token_ids[kept:],
        lp_kept,
        lp_new,
        new.cumulative_logprob,
        new.finish_reason,
        new.stop_reason,
    )


class OutputDecoder:
    """The API process's side: each RequestOutput of one request rebuilt from what the encoder
    sent. Every output is a new object (the handlers may still hold the one before). Prompt
    logprobs cross as arrays (PromptLogprobsList): ``token_text`` names their tokens here."""

    def __init__(self, token_text: Callable[[int], str | None] | None = None):
        self._last: RequestOutput | None = None
        self._token_text = token_text

    def decode(self, payload: RequestOutput | OutputDelta) -> RequestOutput:
        if isinstance(payload.prompt_logprobs, PromptLogprobsList) and self._token_text:
            payload.prompt_logprobs.bind(self._token_text)
        if isinstance(payload, RequestOutput):
            self._last = payload
            return payload
        last = self._last
        if last is None:
            raise ValueError(f"a delta for request {payload.request_id!r} before its first output")
        completions = [
            _apply(d, old) for d, old in zip(payload.completions, last.outputs, strict=True)
        ]
        prompt_logprobs = payload.prompt_logprobs
        if prompt_logprobs is None:
            prompt_logprobs = last.prompt_logprobs
        out = RequestOutput(
            last.request_id,
            last.prompt,
            last.prompt_token_ids,
            completions,
            payload.finished,
            payload.error,
            prompt_logprobs,
            payload.spec_decoding,
            last.metrics if payload.metrics is None else payload.metrics,
        )
        self._last = out
        return out


def _apply(d: CompletionDelta, old: CompletionOutput) -> CompletionOutput:
    if d.logprobs_kept < 0:
        logprobs = d.logprobs_new
    else:
        logprobs = old.logprobs[: d.logprobs_kept] + d.logprobs_new
    return CompletionOutput(
        d.index,
        old.text[: d.text_kept] + d.text_new,
        old.token_ids[: d.tokens_kept] + d.tokens_new,
        d.cumulative_logprob,
        logprobs,
        d.finish_reason,
        d.stop_reason,
    )
