"""What differs between the endpoints' answers, one object per endpoint: a completion's text
choices (its echoed prompt, OpenAI's legacy logprobs with text offsets, vLLM's prompt_logprobs
on each choice) and a chat completion's message and delta choices (the role first, logprobs
with each token's bytes, tool calls taken out of the text, vLLM's chat echo). Responses and
StreamEvents (responses.py) build what both share from the job and call the shape for the rest.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import ClassVar

from pagedjax.entrypoints.openai.logprobs import (
    TextOffsets,
    chat_logprobs,
    clamp,
    completion_logprobs,
    join_logprobs,
    prompt_completion_logprobs,
)
from pagedjax.entrypoints.openai.offload import dumps_bytes
from pagedjax.entrypoints.openai.tools import ToolMode


class ResponseShape:
    """An endpoint's answer: its ids and object names, its choices whole and streamed. ``k``:
    the logprob alternatives per generated token (None: no logprobs); ``prompt_k``: vLLM's
    prompt_logprobs. ``r`` below is the Responses (decoding, token strings), ``events`` the
    StreamEvents (what a stream has sent so far)."""

    id_prefix: ClassVar[str]
    object_kind: ClassVar[str]  # a whole answer's "object"
    chunk_kind: ClassVar[str]  # a streamed chunk's "object"
    k: int | None
    prompt_k: int | None

    def new_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex

    # -- whole answers --

    def generated_tokens(self, outputs) -> int:
        """The tokens of ``outputs`` (one prompt's choices) that count as completion tokens."""
        return sum(len(c.token_ids) for c in outputs)

    def final_choice(self, r, job, i: int, final, c, index: int) -> dict:
        """Choice ``index``: output ``c`` of prompt ``i``'s finished ``final``."""
        raise NotImplementedError

    def add_body_fields(self, r, body: dict, finals) -> None:
        """Fields of the whole body beyond id, object, created, model, choices and usage."""

    @property
    def rewrites_body(self) -> bool:
        """Whether ``finish_body`` changes the encoded body."""
        return False

    def finish_body(self, body: bytes) -> bytes:
        return body

    # -- streams --

    def is_heavy(self) -> bool:
        """Whether every streamed output's events are worth building off the event loop."""
        return self.k is not None

    def delta_choice(self, index: int, text: str, finish, lp, first: bool) -> dict:
        """A streamed chunk's choice, before its stop_reason."""
        raise NotImplementedError

    def opening(self, events) -> list[str]:
        """The events a stream opens with, before any output."""
        return []

    @property
    def prompt_only(self) -> bool:
        """Whether each choice streams its echoed prompt alone (no generated text shown)."""
        return False

    def stream_head(self, events, out, p: int, index: int, finish):
        """(text, logprobs) to send before choice ``index``'s next text, or None while that
        must wait for the prompt's logprobs."""
        return "", None

    def stream_logprobs(self, events, p: int, index: int, c, new_ids, new_lps) -> dict:
        """The logprobs of choice ``index``'s ``new_ids`` (output ``c`` of prompt ``p``)."""
        raise NotImplementedError

    def with_head(self, head: str, head_lp, text: str, lp, p: int):
        """(text, logprobs) of a chunk with ``head`` (from stream_head) before them."""
        return text, lp

    def wrap_stream(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        return events


@dataclasses.dataclass(frozen=True)
class Echo:
    """Completions' echo: each prompt's text comes back before its completion."""

    texts: tuple[str, ...] | list[str]  # one per prompt
    only: bool  # max_tokens=0: the prompt alone (the engine's one token is not shown)


@dataclasses.dataclass(frozen=True)
class CompletionShape(ResponseShape):
    """/v1/completions: ``text`` choices, each with its ``echo``ed prompt if asked."""

    id_prefix: ClassVar[str] = "cmpl-"
    object_kind: ClassVar[str] = "text_completion"
    chunk_kind: ClassVar[str] = "text_completion"
    k: int | None = None
    prompt_k: int | None = None
    echo: Echo | None = None

    def generated_tokens(self, outputs) -> int:
        return 0 if self.prompt_only else super().generated_tokens(outputs)

    def final_choice(self, r, job, i, final, c, index) -> dict:
        finish, reason = c.finish_reason, c.stop_reason
        shown = None if self.prompt_only else c
        if shown is None:
            finish, reason = "length", None
        text = (self.echo.texts[i] if self.echo else "") + (shown.text if shown else "")
        lp = None
        if self.k is not None:
            lp = self._final_logprobs(r, i, job.prompts[i], final, shown, c.text)
        choice = {"index": index, "logprobs": lp, "finish_reason": finish, "text": text}
        choice["stop_reason"] = reason
        if self.prompt_k is not None:
            choice["prompt_logprobs"] = r.prompt_logprobs(final, self.prompt_k)
        return choice

    def _final_logprobs(self, r, i, prompt_ids, out, c, shown_text):
        """A choice's logprobs: the echoed prompt's, then its generated tokens'."""
        gen = None
        if c is not None and c.logprobs is not None:
            offsets = TextOffsets(r.tokenizer, prompt_ids).feed(c.token_ids)
            gen = completion_logprobs(
                r.strings, c.token_ids, c.logprobs, self.k, clamp(offsets, shown_text)
            )
        if self.echo is None or out.prompt_logprobs is None:  # no prompt logprobs: text alone
            return gen
        head = prompt_completion_logprobs(r.strings, prompt_ids, out.prompt_logprobs, self.k)
        head["text_offset"] = clamp(head["text_offset"], self.echo.texts[i])
        return join_logprobs(head, gen, len(self.echo.texts[i]))

    def is_heavy(self) -> bool:
        return self.k is not None or self.echo is not None

    def delta_choice(self, index, text, finish, lp, first) -> dict:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    @property
    def prompt_only(self) -> bool:
        return self.echo is not None and self.echo.only

    def stream_head(self, events, out, p, index, finish):
        """The echoed prompt (and its logprobs) if not sent yet."""
        if self.echo is None or index in events.echoed:
            return "", None
        if self.k is not None and out.prompt_logprobs is None and not finish:
            return None  # the prompt's logprobs come once it is all scored
        events.echoed.add(index)
        head, head_lp = self.echo.texts[p], None
        if self.k is not None and out.prompt_logprobs is not None:
            head_lp = prompt_completion_logprobs(
                events.r.strings, events.job.prompts[p], out.prompt_logprobs, self.k
            )
            head_lp["text_offset"] = clamp(head_lp["text_offset"], head)
        return head, head_lp

    def stream_logprobs(self, events, p, index, c, new_ids, new_lps) -> dict:
        tracker = events.offsets.setdefault(
            index, TextOffsets(events.r.tokenizer, events.job.prompts[p])
        )
        offsets = clamp(tracker.feed(new_ids), c.text)
        return completion_logprobs(events.r.strings, new_ids, new_lps, self.k, offsets)

    def with_head(self, head, head_lp, text, lp, p):
        if self.echo is None:
            return text, lp
        if lp is not None:
            shift = len(self.echo.texts[p])
            lp["text_offset"] = [o + shift for o in lp["text_offset"]]
        lp = join_logprobs(head_lp, lp, 0) if head_lp is not None else lp
        return head + text, lp


@dataclasses.dataclass(frozen=True)
class ChatShape(ResponseShape):
    """/v1/chat/completions: assistant ``message`` choices, ``delta``s when streamed; ``tools``
    reads tool calls out of the text; ``echo``: the text the reply continues (vLLM's)."""

    id_prefix: ClassVar[str] = "chatcmpl-"
    object_kind: ClassVar[str] = "chat.completion"
    chunk_kind: ClassVar[str] = "chat.completion.chunk"
    k: int | None = None
    prompt_k: int | None = None  # once for the response, not per choice
    tools: ToolMode | None = None
    echo: str = ""

    def final_choice(self, r, job, i, final, c, index) -> dict:
        lp = None
        if self.k is not None and c.logprobs is not None:
            lp = chat_logprobs(r.strings, c.token_ids, c.logprobs, self.k)
        choice = {"index": index, "logprobs": lp, "finish_reason": c.finish_reason}
        choice["message"] = {"role": "assistant", "content": c.text}
        choice["stop_reason"] = c.stop_reason
        return choice

    def add_body_fields(self, r, body, finals) -> None:
        if self.prompt_k is not None:
            body["prompt_logprobs"] = r.prompt_logprobs(finals[0], self.prompt_k)

    @property
    def rewrites_body(self) -> bool:
        return self.tools is not None or bool(self.echo)

    def finish_body(self, body: bytes) -> bytes:
        """Each choice's tool calls out of its text, then the echo before every message."""
        if self.tools is not None:
            body = self.tools.final_body(body)
        if self.echo:
            body = with_chat_echo(body, self.echo)
        return body

    def delta_choice(self, index, text, finish, lp, first) -> dict:
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def opening(self, events) -> list[str]:
        """Each choice's role (and the echoed assistant message)."""
        count = len(events.job.prompts) * events.job.n
        opened = [events.chunk(i, "", None, None, first=True) for i in range(count)]
        if self.echo:
            opened += [events.chunk(i, self.echo, None, None) for i in range(count)]
        return opened

    def stream_logprobs(self, events, p, index, c, new_ids, new_lps) -> dict:
        return chat_logprobs(events.r.strings, new_ids, new_lps, self.k)

    def wrap_stream(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        return self.tools.events(events) if self.tools is not None else events


def with_chat_echo(body: bytes, text: str) -> bytes:
    """A chat response whose every message begins with ``text`` (vLLM's chat echo)."""
    data = json.loads(body)
    for choice in data["choices"]:
        choice["message"]["content"] = text + (choice["message"]["content"] or "")
    return dumps_bytes(data)
