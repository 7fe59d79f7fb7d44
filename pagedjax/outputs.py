"""What ``LLM.generate`` returns, shaped like vLLM's RequestOutput."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" (EOS / stop token), "length", "abort", or None (running)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Set when the engine ended the request itself (it could not run it, or it failed on its
    # own): its completions then finish with "abort" and keep what was generated so far.
    error: str | None = None
