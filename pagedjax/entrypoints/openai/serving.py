"""The FastAPI app: /v1/completions, /v1/chat/completions (both streaming as server-sent events),
/v1/models, /health, Prometheus /metrics and the API docs.

A request is validated whole (protocol), every prompt passes the engine's admission check, and
only then is anything submitted to the engine thread (engine_loop). A request that fails inside
the engine ends with OpenAI's error JSON, or, once a stream's headers are out, with an error event
and ``[DONE]``; it never takes another request with it.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import itertools
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedjax.entrypoints.openai.engine_loop import EngineLoop, QueueFull
from pagedjax.entrypoints.openai.logprobs import (
    TextOffsets,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
)
from pagedjax.entrypoints.openai.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ServerLimits,
    bad_request,
    chat_messages,
    error_response,
    parse_json,
    parse_request,
    sampling_params,
)
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger("pagedjax.api_server")

_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


def check_api_key(api_key: str | None) -> None:
    """An empty key would turn authentication off without saying so: refuse it."""
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty; pass a key, or leave the option out to serve openly")


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


def build_app(
    engine,
    served_model_name: str | list[str],
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    *,
    public_metrics: bool = False,
    public_docs: bool = False,
) -> FastAPI:
    """The FastAPI app over ``engine``; the engine thread starts and stops with the app.

    ``served_model_name`` is the model id, or several aliases: requests may name any of them,
    /v1/models lists them all, responses carry the first. With ``api_key`` every route but
    /health needs it, /metrics and the API docs too unless ``public_metrics`` / ``public_docs``
    open them.
    """
    check_api_key(api_key)
    model_names = (
        [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    )
    if not model_names or not all(isinstance(n, str) and n for n in model_names):
        raise ValueError(f"served model names must be non-empty strings, got {model_names!r}")
    limits = limits or ServerLimits()
    loop_owner = EngineLoop(engine, max_queue=limits.max_queue)
    tokenizer = copy.deepcopy(engine.tokenizer)  # the handlers' own: tokenizers aren't shareable
    strings = TokenStrings(tokenizer)
    max_model_len = engine.config.scheduler.max_model_len
    vocab = engine.model_config.vocab_size
    created = int(time.time())
    counter = itertools.count()

    @asynccontextmanager
    async def lifespan(app):
        loop_owner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop_owner.stop)

    app = FastAPI(
        title="pagedjax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.engine_loop = loop_owner
    app.state.limits = limits

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {exc}", "server_error")

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(
                401, "invalid or missing API key", "invalid_request_error", "invalid_api_key"
            )

    async def read_json(request: Request):
        """The body, parsed strictly; it must arrive within ``limits.body_timeout_s``."""
        too_big = APIError(
            413, f"request body over {limits.max_body_bytes} bytes", "invalid_request_error"
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            raise too_big
        body = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_s
        chunks = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(anext(chunks), deadline - loop.time())
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {limits.body_timeout_s} s",
                    "invalid_request_error",
                    "request_timeout",
                ) from None
            except ClientDisconnect:
                raise bad_request("the client left before sending the whole body") from None
            body += chunk
            if len(body) > limits.max_body_bytes:
                raise too_big
        return parse_json(bytes(body))

    def parse(model_cls, data):
        req = parse_request(model_cls, data)
        if req.model not in model_names:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {model_names}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return req

    def tokenize(text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer; send prompts as token ids", param)
        try:
            return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except Exception as e:  # the tokenizer refuses some text; that is the client's input
            raise bad_request(f"the tokenizer failed on this text: {e}", param) from None

    def check_token_ids(ids: list[int]) -> None:
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab})", "prompt")

    def admit(prompts: list[list[int]], params: SamplingParams, param: str) -> None:
        """The engine's admission check on every prompt, before anything is submitted."""
        for ids in prompts:
            try:
                engine.check_request(ids, params)
            except ValueError as e:
                code = "context_length_exceeded" if len(ids) >= max_model_len else None
                raise bad_request(str(e), param, code) from None

    def check_engine_thread() -> None:
        """A request waiting on a dead engine thread would wait forever: fail it instead."""
        if not loop_owner.is_running:
            raise APIError(500, "the engine thread has stopped", "server_error", "engine_error")

    async def start(prompts: list[list[int]], params: SamplingParams) -> _Job:
        job = _Job(asyncio.get_running_loop())
        base = f"{next(counter)}-{uuid.uuid4().hex[:8]}"
        try:
            for i, ids in enumerate(prompts):
                rid = f"{base}-{i}"
                fut = asyncio.wrap_future(loop_owner.submit(rid, ids, params, job.sink))
                job.request_ids.append(rid)
                while not (await asyncio.wait({fut}, timeout=_POLL_S))[0]:
                    check_engine_thread()
                fut.result()
        except BaseException as e:
            for rid in job.request_ids:
                loop_owner.abort(rid)
            if isinstance(e, QueueFull):
                raise APIError(503, f"server busy: {e}", "server_error", "queue_full") from None
            if isinstance(e, ValueError):
                raise bad_request(str(e)) from None
            raise
        return job

    async def next_output(request: Request, job: _Job) -> RequestOutput | None:
        """The next output, or None if the client went away (its requests are then aborted).
        A request the engine failed raises APIError."""
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), _POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                check_engine_thread()
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

    def abort_unfinished(job: _Job) -> None:
        for rid in job.request_ids:
            if rid not in job.finished:
                loop_owner.abort(rid)

    def usage(prompts, num_generated: int) -> dict:
        num_prompt = sum(len(p) for p in prompts)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated,
        }

    def clamp(offsets: list[int], text: str) -> list[int]:
        return [min(o, len(text)) for o in offsets]

    # -- the shared generation driver: final choices or streamed deltas --

    async def run(request, req, prompts, params, chat: bool, k_logprobs: int | None):
        job = await start(prompts, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            gen = stream(request, job, rid, now, prompts, params, chat, k_logprobs, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        finals: dict[str, RequestOutput] = {}
        try:
            while not job.done:
                out = await next_output(request, job)
                if out is None:
                    return PlainTextResponse("", status_code=499)
                if out.finished:
                    finals[out.request_id] = out
        finally:
            abort_unfinished(job)
        choices, generated, n = [], 0, params.n
        for i, r in enumerate(job.request_ids):
            for c in finals[r].outputs:
                generated += len(c.token_ids)
                lp = None
                if k_logprobs is not None and c.logprobs is not None:
                    if chat:
                        lp = chat_logprobs(strings, c.token_ids, c.logprobs, k_logprobs)
                    else:
                        offsets = TextOffsets(tokenizer, prompts[i]).feed(c.token_ids)
                        lp = completion_logprobs(
                            strings, c.token_ids, c.logprobs, k_logprobs, clamp(offsets, c.text)
                        )
                choice = {
                    "index": i * n + c.index,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
                if chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now,
            "model": model_names[0],
            "choices": choices,
            "usage": usage(prompts, generated),
        }
        return JSONResponse(body)

    async def stream(request, job, rid, now, prompts, params, chat, k_logprobs, include_usage):
        kind = "chat.completion.chunk" if chat else "text_completion"
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
                    "model": model_names[0],
                    "choices": [choice],
                }
            )

        try:
            if chat:
                for r in job.request_ids:
                    for i in range(n):
                        yield chunk(index_of[r] * n + i, "", None, None, first=True)
            while not job.done:
                out = await next_output(request, job)
                if out is None:
                    return  # the client left; nobody reads a [DONE]
                p = index_of[out.request_id]
                for c in out.outputs:
                    index = p * n + c.index
                    if index in done:
                        continue
                    finish = c.finish_reason
                    start_t, start_k = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    end_t = len(c.text) if finish else max(len(c.text) - hold, start_t)
                    new_ids = c.token_ids[start_k:]
                    lp = None
                    if k_logprobs is not None and c.logprobs is not None and new_ids:
                        new_lps = c.logprobs[start_k:]
                        if chat:
                            lp = chat_logprobs(strings, new_ids, new_lps, k_logprobs)
                        else:
                            tracker = offsets.setdefault(index, TextOffsets(tokenizer, prompts[p]))
                            offs = clamp(tracker.feed(new_ids), c.text)
                            lp = completion_logprobs(strings, new_ids, new_lps, k_logprobs, offs)
                    text = c.text[start_t:end_t]
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
                        "model": model_names[0],
                        "choices": [],
                        "usage": usage(prompts, job.generated),
                    }
                )
        except APIError as e:  # after the headers: OpenAI's error, as an event
            yield event(e.body())
        except Exception as e:
            logger.exception("stream failed")
            yield event(APIError(500, f"internal error: {e}", "server_error").body())
        finally:
            abort_unfinished(job)
        yield "data: [DONE]\n\n"

    # -- routes --

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health():
        if not loop_owner.is_running:
            return error_response(503, "the engine thread is not running", "server_error")
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics(request: Request):
        if not public_metrics:
            check_key(request)
        return PlainTextResponse(
            loop_owner.render_metrics(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        if not public_docs:
            check_key(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        if not public_docs:
            check_key(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pagedjax")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        if not public_docs:
            check_key(request)
        return get_redoc_html(openapi_url="/openapi.json", title="pagedjax")

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagedjax",
            "max_model_len": max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card(name) for name in model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        check_key(request)
        if model_id not in model_names:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist; this server serves {model_names}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        req = parse(CompletionRequest, await read_json(request))
        p = req.prompt
        if isinstance(p, str):
            texts, prompts = [p], None
        elif p and all(isinstance(x, str) for x in p):
            texts, prompts = p, None
        elif p and all(isinstance(x, list) for x in p):
            texts, prompts = None, [list(x) for x in p]
        else:
            texts, prompts = None, [list(p)]
        count = len(texts or prompts)
        if count > limits.max_queue:
            raise bad_request(
                f"prompt: {count} prompts in one request; this server queues at most "
                f"{limits.max_queue}",
                "prompt",
            )
        if prompts is None:
            prompts = [tokenize(t, "prompt") for t in texts]
        for ids in prompts:
            check_token_ids(ids)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = max(max_model_len - max(len(x) for x in prompts), 1)
        params = sampling_params(req, max_tokens, "max_tokens", req.logprobs, limits)
        admit(prompts, params, "prompt")
        return await run(request, req, prompts, params, chat=False, k_logprobs=req.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        req = parse(ChatRequest, await read_json(request))
        if tokenizer is None or tokenizer.chat_template is None:
            raise bad_request("this model's tokenizer has no chat template")
        messages = chat_messages(req)
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:
            raise bad_request(f"the chat template failed on these messages: {e}") from None
        ids = tokenize(text, "messages", add_special_tokens=False)
        if req.max_completion_tokens is not None:
            max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = req.max_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = max(max_model_len - len(ids), 1)
        k = None
        if req.logprobs:
            k = req.top_logprobs or 0
        elif req.top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        params = sampling_params(req, max_tokens, field, k, limits)
        admit([ids], params, "messages")
        return await run(request, req, [ids], params, chat=True, k_logprobs=k)

    return app
