"""What the OpenAI endpoints share: prompt admission, submitting a request's prompts to the
engine thread, and the two ways of answering — final choices, or streamed server-sent events.

A request that fails inside the engine ends with OpenAI's error JSON, or, once a stream's headers
are out, with an error event and ``[DONE]``; it never takes another request with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pagedjax.entrypoints.openai.engine_loop import EngineLoop, QueueFull
from pagedjax.entrypoints.openai.logprobs import (
    TextOffsets,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    join_logprobs,
    prompt_completion_logprobs,
)
from pagedjax.entrypoints.openai.protocol import APIError, bad_request
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger("pagedjax.api_server")

_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


@dataclasses.dataclass
class Echo:
    """Completions' echo: each prompt's text comes back before its completion."""

    texts: list[str]  # one per prompt
    only: bool  # max_tokens=0: the prompt alone (the engine's one token is not shown)


class _Job:
    """One HTTP request's engine requests (one per prompt) and the queue their outputs land on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.request_ids: list[str] = []
        self.finished: set[str] = set()
        self.generated = 0  # tokens streamed so far, for the usage chunk

    def sink(self, item) -> None:  # called on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)


class OpenAIServing:
    """The engine as the endpoints see it: through the engine loop and one tokenizer."""

    def __init__(self, engine, engine_loop: EngineLoop, tokenizer, model_name: str):
        self.engine = engine
        self.engine_loop = engine_loop
        self.tokenizer = tokenizer  # the handlers' own copy: tokenizers are not shareable
        self.strings = TokenStrings(tokenizer)
        self.model_name = model_name  # the name responses carry
        self.max_model_len = engine.config.scheduler.max_model_len
        self.vocab = engine.model_config.vocab_size
        self._counter = itertools.count()

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer; send prompts as token ids", param)
        try:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except Exception as e:  # the tokenizer refuses some text; that is the client's input
            raise bad_request(f"the tokenizer failed on this text: {e}", param) from None

    def detokenize(self, ids: list[int]) -> str:
        tok = self.tokenizer
        return "" if tok is None else tok.decode(ids, skip_special_tokens=True)

    def check_token_ids(self, ids: list[int]) -> None:
        for t in ids:
            if not 0 <= t < self.vocab:
                raise bad_request(
                    f"token id {t} is outside the vocabulary [0, {self.vocab})", "prompt"
                )

    def admit(self, prompts: list[list[int]], params: SamplingParams, param: str) -> None:
        """The engine's admission check on every prompt, before anything is submitted."""
        for ids in prompts:
            try:
                self.engine.check_request(ids, params)
            except ValueError as e:
                code = "context_length_exceeded" if len(ids) >= self.max_model_len else None
                field = str(e).split(":", 1)[0]
                if field in ("logit_bias", "stop_token_ids"):
                    param = field
                raise bad_request(str(e), param, code) from None

    async def check_constraint(self, constraint, param: str) -> None:
        """Compile a structured-output constraint before admission, off the event loop (the
        first one builds the tokenizer's index); a 400 names what is wrong with it."""
        if constraint is None:
            return
        compiler = self.engine.input_processor.grammars
        try:
            await asyncio.to_thread(compiler.compile, constraint)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def check_engine_thread(self) -> None:
        """A request waiting on a dead engine thread would wait forever: fail it instead."""
        if not self.engine_loop.is_running:
            raise APIError(500, "the engine thread has stopped", "server_error", "engine_error")

    async def start(self, prompts: list[list[int]], params: SamplingParams) -> _Job:
        job = _Job(asyncio.get_running_loop())
        base = f"{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        try:
            for i, ids in enumerate(prompts):
                rid = f"{base}-{i}"
                fut = asyncio.wrap_future(self.engine_loop.submit(rid, ids, params, job.sink))
                job.request_ids.append(rid)
                while not (await asyncio.wait({fut}, timeout=_POLL_S))[0]:
                    self.check_engine_thread()
                fut.result()
        except BaseException as e:
            for rid in job.request_ids:
                self.engine_loop.abort(rid)
            if isinstance(e, QueueFull):
                raise APIError(503, f"server busy: {e}", "server_error", "queue_full") from None
            if isinstance(e, ValueError):
                raise bad_request(str(e)) from None
            raise
        return job

    async def next_output(self, request: Request, job: _Job) -> RequestOutput | None:
        """The next output, or None if the client went away (its requests are then aborted).
        A request the engine failed raises APIError."""
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), _POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                self.check_engine_thread()
                continue
            if isinstance(item, Exception):
                raise APIError(500, f"the engine failed: {item}", "server_error", "engine_error")
            if item.finished:
                job.finished.add(item.request_id)
            if item.error is not None:
                raise APIError(
                    500,
                    f"the request failed in the engine: {item.error}",
                    "server_error",
                    "request_failed",
                )
            return item

    def abort_unfinished(self, job: _Job) -> None:
        for rid in job.request_ids:
            if rid not in job.finished:
                self.engine_loop.abort(rid)

    @staticmethod
    def usage(prompts, num_generated: int) -> dict:
        num_prompt = sum(len(p) for p in prompts)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated,
        }

    @staticmethod
    def clamp(offsets: list[int], text: str) -> list[int]:
        return [min(o, len(text)) for o in offsets]

    # -- the shared generation driver: final choices or streamed deltas --

    def _completion_logprobs(self, echo, i, prompt_ids, out, c, k, shown_text):
        """A completion choice's logprobs: the echoed prompt's, then its generated tokens'."""
        gen = None
        if c is not None and c.logprobs is not None:
            offsets = TextOffsets(self.tokenizer, prompt_ids).feed(c.token_ids)
            gen = completion_logprobs(
                self.strings, c.token_ids, c.logprobs, k, self.clamp(offsets, shown_text)
            )
        if echo is None:
            return gen
        if out.prompt_logprobs is None:  # no logprobs asked: the prompt's text alone
            return gen
        head = prompt_completion_logprobs(self.strings, prompt_ids, out.prompt_logprobs, k)
        head["text_offset"] = self.clamp(head["text_offset"], echo.texts[i])
        return join_logprobs(head, gen, len(echo.texts[i]))

    async def run(
        self, request, req, prompts, params, chat: bool, k_logprobs: int | None, echo=None
    ):
        job = await self.start(prompts, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            gen = self.stream(
                request, job, rid, now, prompts, params, chat, k_logprobs, include_usage, echo
            )
            return StreamingResponse(gen, media_type="text/event-stream")
        finals: dict[str, RequestOutput] = {}
        try:
            while not job.done:
                out = await self.next_output(request, job)
                if out is None:
                    return PlainTextResponse("", status_code=499)
                if out.finished:
                    finals[out.request_id] = out
        finally:
            self.abort_unfinished(job)
        choices, generated, n = [], 0, req.n
        for i, r in enumerate(job.request_ids):
            outs = finals[r].outputs
            if echo is None or not echo.only:
                generated += sum(len(c.token_ids) for c in outs)
            if len(outs) > n:  # best_of: the n of highest cumulative logprob, best first
                outs = sorted(outs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
            for rank, c in enumerate(outs):
                index = i * n + (rank if params.n > n else c.index)
                lp, finish = None, c.finish_reason
                if chat:
                    if k_logprobs is not None and c.logprobs is not None:
                        lp = chat_logprobs(self.strings, c.token_ids, c.logprobs, k_logprobs)
                    choice = {"index": index, "logprobs": lp, "finish_reason": finish}
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    shown = None if echo is not None and echo.only else c
                    if shown is None:
                        finish = "length"
                    text = (echo.texts[i] if echo else "") + (shown.text if shown else "")
                    if k_logprobs is not None:
                        lp = self._completion_logprobs(
                            echo, i, prompts[i], finals[r], shown, k_logprobs, c.text
                        )
                    choice = {"index": index, "logprobs": lp, "finish_reason": finish}
                    choice["text"] = text
                if c.stop_reason is not None:  # why a grammar could go no further
                    choice["stop_reason"] = c.stop_reason
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(prompts, generated),
        }
        return JSONResponse(body)

    async def stream(
        self, request, job, rid, now, prompts, params, chat, k_logprobs, include_usage, echo=None
    ):
        kind = "chat.completion.chunk" if chat else "text_completion"
        echoed: set[int] = set()  # choices whose echoed prompt is sent
        index_of = {r: i for i, r in enumerate(job.request_ids)}
        n = params.n
        hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be forming
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        offsets: dict[int, TextOffsets] = {}

        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        def chunk(index, text, finish, lp, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            return event(
                {
                    "id": rid,
                    "object": kind,
                    "created": now,
                    "model": self.model_name,
                    "choices": [choice],
                }
            )

        try:
            if chat:
                for r in job.request_ids:
                    for i in range(n):
                        yield chunk(index_of[r] * n + i, "", None, None, first=True)
            while not job.done:
                out = await self.next_output(request, job)
                if out is None:
                    return  # the client left; nobody reads a [DONE]
                p = index_of[out.request_id]
                for c in out.outputs:
                    index = p * n + c.index
                    if index in done:
                        continue
                    finish = c.finish_reason
                    head, head_lp = "", None
                    if echo is not None and index not in echoed:
                        if k_logprobs is not None and out.prompt_logprobs is None and not finish:
                            continue  # the prompt's logprobs come once it is all scored
                        echoed.add(index)
                        head = echo.texts[p]
                        if k_logprobs is not None and out.prompt_logprobs is not None:
                            head_lp = prompt_completion_logprobs(
                                self.strings, prompts[p], out.prompt_logprobs, k_logprobs
                            )
                            head_lp["text_offset"] = self.clamp(head_lp["text_offset"], head)
                    if echo is not None and echo.only:  # the prompt alone
                        if finish:
                            done.add(index)
                        if head or head_lp or finish:
                            yield chunk(index, head, "length" if finish else None, head_lp)
                        continue
                    start_t, start_k = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    end_t = len(c.text) if finish else max(len(c.text) - hold, start_t)
                    new_ids = c.token_ids[start_k:]
                    lp = None
                    if k_logprobs is not None and c.logprobs is not None and new_ids:
                        new_lps = c.logprobs[start_k:]
                        if chat:
                            lp = chat_logprobs(self.strings, new_ids, new_lps, k_logprobs)
                        else:
                            tracker = offsets.setdefault(
                                index, TextOffsets(self.tokenizer, prompts[p])
                            )
                            offs = self.clamp(tracker.feed(new_ids), c.text)
                            lp = completion_logprobs(
                                self.strings, new_ids, new_lps, k_logprobs, offs
                            )
                    text = c.text[start_t:end_t]
                    if echo is not None:
                        if lp is not None:
                            shift = len(echo.texts[p])
                            lp["text_offset"] = [o + shift for o in lp["text_offset"]]
                        lp = join_logprobs(head_lp, lp, 0) if head_lp is not None else lp
                        text = head + text
                    sent_text[index], sent_tokens[index] = end_t, len(c.token_ids)
                    job.generated += len(new_ids)
                    if finish:
                        done.add(index)
                    if text or lp or finish:
                        yield chunk(index, text, finish, lp)
            if include_usage:
                yield event(
                    {
                        "id": rid,
                        "object": kind,
                        "created": now,
                        "model": self.model_name,
                        "choices": [],
                        "usage": self.usage(prompts, job.generated),
                    }
                )
        except APIError as e:  # after the headers: OpenAI's error, as an event
            yield event(e.body())
        except Exception as e:
            logger.exception("stream failed")
            yield event(APIError(500, f"internal error: {e}", "server_error").body())
        finally:
            self.abort_unfinished(job)
        yield "data: [DONE]\n\n"
