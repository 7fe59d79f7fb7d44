"""What the OpenAI endpoints share (vLLM's serving_engine.py, under serving_completion.py,
serving_chat.py and serving_tokenization.py): prompt tokenizing and chat rendering, the checks
before admission, and running a GenerationJob (job.py) — its prompts submitted to the engine,
its outputs awaited, and its answer given whole or streamed as server-sent events, by its
shape. Tokenizing, grammar compilation and response building run on the offload pool.

A request that fails inside the engine ends with OpenAI's error JSON, or, once a stream's headers
are out, with an error event and ``[DONE]``; it never takes another request with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from pagedjax.core.request_queue import check_priority
from pagedjax.engine.client import EngineClient, QueueFull
from pagedjax.engine.input_processor import truncated
from pagedjax.entrypoints.chat_template import ChatOptions
from pagedjax.entrypoints.openai.job import GenerationJob
from pagedjax.entrypoints.openai.offload import Offload
from pagedjax.entrypoints.openai.output_collector import Job as _Job
from pagedjax.entrypoints.openai.output_collector import Wakeups as _Wakeups
from pagedjax.entrypoints.openai.protocol import APIError, ServerLimits, bad_request
from pagedjax.entrypoints.openai.request_params import ParamsContext, check_response_logprobs
from pagedjax.entrypoints.openai.responses import Responses, StreamEvents
from pagedjax.models.loading.tokenizer import encode_text, max_chars_per_token
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["OpenAIServing"]

logger = logging.getLogger("pagedjax.api_server")

_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class OpenAIServing:
    """The engine as the endpoints see it: through its client (engine/client.py), with
    tokenizing, grammar compilation and response building on the offload pool (never on the
    event loop). Each endpoint is a subclass; engine request ids are unique across them."""

    _ids = itertools.count()  # engine request ids' prefix, shared by every endpoint

    def __init__(
        self, client: EngineClient, tokenizer, model_name: str, offload, limits: ServerLimits
    ):
        self.client = client
        self.offload: Offload = offload
        self.tokenizer = tokenizer  # the handlers' own copy; encoding uses offload.tokenizer
        self.limits = limits
        self.responses = Responses(tokenizer, client.eos_token_ids, model_name)
        self.max_model_len = client.max_model_len
        # a text of c characters is at least c / k tokens (None: no such bound)
        self.chars_per_token = max_chars_per_token(tokenizer)
        self.vocab = client.model_config.vocab_size
        # the model's sampling defaults (its generation config), for fields a request leaves unset
        self.defaults: dict = client.default_sampling_params
        self.params_context = ParamsContext(limits, self.defaults, self.vocab)
        self._wakeups: _Wakeups | None = None  # for the event loop the handlers run on

    # -- on the offload pool --

    def tokenize(
        self, text: str, param: str, add_special_tokens: bool = True, bounded: bool = True
    ) -> list[int]:
        """``text``'s ids; ``bounded``: refused unencoded when no tokenization could fit the
        context (not when the prompt is truncated, or only counted)."""
        tok = self.offload.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer; send prompts as token ids", param)
        k = self.chars_per_token
        if bounded and k is not None and len(text) >= k * self.max_model_len:  # cannot fit
            raise bad_request(
                f"the prompt has at least {len(text) // k} tokens ({len(text)} characters, at "
                f"most {k} per token) and leaves no room to generate within "
                f"max_model_len={self.max_model_len}",
                param,
                "context_length_exceeded",
            )
        try:
            return encode_text(tok, text, add_special_tokens)
        except Exception as e:  # the tokenizer refuses some text; that is the client's input
            raise bad_request(f"the tokenizer failed on this text: {e}", param) from None

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        for t in ids:
            if not 0 <= t < self.vocab:
                raise bad_request(
                    f"token id {t} is outside the vocabulary [0, {self.vocab})", param
                )

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        options: ChatOptions,
        truncate: int | None = None,
        bounded: bool = True,
    ) -> list[int]:
        """The conversation rendered and tokenized, its last ``truncate`` tokens if given
        (``bounded``: refused unencoded when its text cannot fit the context)."""
        tok = self.offload.tokenizer
        if tok is None or tok.chat_template is None:
            raise bad_request("this model's tokenizer has no chat template", "messages")
        try:
            text = options.render(tok, messages, tools)
        except Exception as e:
            raise bad_request(f"the chat template failed on these messages: {e}") from None
        bounded = bounded and truncate is None
        ids = self.tokenize(text, "messages", options.add_special_tokens, bounded)
        return truncated(ids, truncate, self.max_model_len)

    def _admit(self, prompts: list[list[int]], params: SamplingParams, param: str) -> None:
        for ids in prompts:
            try:
                self.client.check_request(ids, params)
            except ValueError as e:
                code = "context_length_exceeded" if len(ids) >= self.max_model_len else None
                field = str(e).split(":", 1)[0]
                if field in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
                    param = field
                raise bad_request(str(e), param, code) from None

    # -- awaited by the handlers --

    async def admit(self, prompts: list[list[int]], params: SamplingParams, param: str) -> None:
        """The engine's admission check on every prompt, before anything is submitted."""
        await self.offload.run(self._admit, prompts, params, param)

    async def check_constraint(self, constraint, param: str) -> None:
        """Compile a structured-output constraint before admission (the first one builds the
        tokenizer's index); a 400 names what is wrong with it."""
        if constraint is None:
            return
        try:
            await self.offload.run_grammar(self.client.compile_grammar, constraint)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def check_engine_thread(self) -> None:
        """A request waiting on a dead engine thread would wait forever: fail it instead."""
        if not self.client.is_running:
            raise APIError(500, "the engine thread has stopped", "server_error", "engine_error")

    def check_priority(self, priority: int) -> None:
        """vLLM's ``priority``: any integer under --scheduling-policy priority, else only 0."""
        try:
            check_priority(priority, self.client.config.scheduler.policy)
        except ValueError as e:
            raise bad_request(str(e), "priority") from None

    def check_prompt_logprobs(self, prompts: list[list[int]], k: int | None) -> None:
        """vLLM's prompt_logprobs: k alternatives and its own per token of each of ``prompts``."""
        check_response_logprobs(
            self.limits, prompts, k=k, n=1, max_tokens=0, echo=True, field="prompt_logprobs"
        )

    async def start(self, job: GenerationJob) -> _Job:
        """Submit one engine request per prompt of ``job`` (under its LoRA adapter, with its
        priority), all in one command: the engine takes them between the same two steps."""
        params = job.params
        lp = getattr(params, "logprobs", None), getattr(params, "prompt_logprobs", None)
        if lp != (None, None):  # beam search asks for neither
            self.offload.mark_heavy()  # its outputs are turned into events in the heavy lane
        loop = asyncio.get_running_loop()
        if self._wakeups is None or self._wakeups.loop is not loop:
            self._wakeups = _Wakeups(loop)
        cumulative = params.output_kind == RequestOutputKind.CUMULATIVE
        collector = _Job(loop, cumulative, self._wakeups)
        base = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        collector.request_ids = [f"{base}-{i}" for i in range(len(job.prompts))]
        ids = zip(collector.request_ids, job.prompts, strict=True)
        requests = [(rid, prompt, collector.sink) for rid, prompt in ids]
        try:
            for fut in self.client.submit(requests, params, job.lora, job.priority):
                fut = asyncio.wrap_future(fut)
                while not (await asyncio.wait({fut}, timeout=_POLL_S))[0]:
                    self.check_engine_thread()
                fut.result()
        except BaseException as e:
            for rid in collector.request_ids:
                self.client.abort(rid)
            if isinstance(e, QueueFull):
                raise APIError(503, f"server busy: {e}", "server_error", "queue_full") from None
            if isinstance(e, ValueError):
                raise bad_request(str(e)) from None
            raise
        return collector

    async def next_outputs(self, request: Request, job: _Job) -> list[RequestOutput] | None:
        """The outputs that arrived since the last call (each request's latest), waiting for
        one; None if the client went away (its requests are then aborted). A request the engine
        failed raises APIError (after the outputs before it were read)."""
        while True:
            items = await job.wait(_POLL_S)
            if not items:
                if await request.is_disconnected():
                    return None
                self.check_engine_thread()
                continue
            for i, item in enumerate(items):
                failed = isinstance(item, Exception) or item.error is not None
                if failed and i:  # the outputs before it first
                    job.hold(items[i:])
                    return items[:i]
                if isinstance(item, Exception):
                    raise APIError(
                        500, f"the engine failed: {item}", "server_error", "engine_error"
                    )
                if item.finished:
                    job.finished.add(item.request_id)
                if item.error is not None:
                    raise APIError(
                        500,
                        f"the request failed in the engine: {item.error}",
                        "server_error",
                        "request_failed",
                    )
            return items

    def abort_unfinished(self, job: _Job) -> None:
        for rid in job.request_ids:
            if rid not in job.finished:
                self.client.abort(rid)

    async def run(self, request: Request, job: GenerationJob) -> Response:
        """Answer ``job``: streamed (as its shape's chunks) or whole (its shape's body)."""
        collector = await self.start(job)
        responses = self.responses.for_job(job)
        if job.stream is not None:
            events = StreamEvents(responses, job, collector.request_ids)
            gen = job.shape.wrap_stream(self.stream(request, collector, events))
            return StreamingResponse(gen, media_type="text/event-stream")
        finals: dict[str, RequestOutput] = {}
        try:
            while not collector.done:
                outs = await self.next_outputs(request, collector)
                if outs is None:
                    return PlainTextResponse("", status_code=499)
                finals.update((out.request_id, out) for out in outs if out.finished)
        finally:
            self.abort_unfinished(collector)
        ordered = [finals[r] for r in collector.request_ids]
        body = await self.offload.run(responses.final_body, job, ordered)
        if job.shape.rewrites_body:
            body = await self.offload.run(job.shape.finish_body, body)
        return Response(body, media_type="application/json")

    async def stream(self, request, job: _Job, events: StreamEvents):
        try:
            for e in events.opening():
                yield e
            while not job.done:
                outs = await self.next_outputs(request, job)
                if outs is None:
                    return  # the client left; nobody reads a [DONE]
                for out in outs:
                    if events.is_heavy(out):
                        batch = await self.offload.run(events.events, out)
                    else:
                        batch = events.events(out)
                    for e in batch:
                        yield e
            if events.job.stream.include_usage:
                yield events.usage_event()
        except APIError as e:  # after the headers: OpenAI's error, as an event
            yield events.event(e.body())
        except Exception as e:
            logger.exception("stream failed")
            yield events.event(APIError(500, f"internal error: {e}", "server_error").body())
        finally:
            self.abort_unfinished(job)
        yield "data: [DONE]\n\n"
