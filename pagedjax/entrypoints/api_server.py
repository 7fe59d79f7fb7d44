"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both streaming as
server-sent events), /v1/models, /health and Prometheus /metrics.

One thread owns the engine: it applies queued commands (add, abort), runs ``engine.step()`` and
hands each RequestOutput to the asyncio queue of the HTTP request waiting for it. Handlers never
touch the engine; they tokenize with their own copy of the tokenizer and talk through commands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hmac
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger("pagedjax.api_server")

DEFAULT_MAX_QUEUE = 256  # requests waiting for admission before new ones get 503
DEFAULT_MAX_BODY_BYTES = 1 << 20
_POLL_S = 0.25  # how often a waiting handler checks that its client is still there
# Multi-process: how often an idle driver pings its followers, which wait for it in a collective
# (a backend may time out a wait of hours).
_KEEP_ALIVE_S = 10.0


# ---- errors ---------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.code, self.param)


def error_response(status, message, type_="invalid_request_error", code=None, param=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


class _QueueFull(Exception):
    pass


# ---- request bodies (OpenAI's fields, plus a few of vLLM's extras) ---------------------------


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---- metrics --------------------------------------------------------------------------------


class _Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for b, c in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{self.name}_bucket{{le="{b}"}} {c}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Metrics:
    """Counters kept by the engine thread; gauges are a snapshot it refreshes every loop."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.ttft = _Histogram(
            "pagedjax_time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.tpot = _Histogram(
            "pagedjax_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _TPOT_BUCKETS,
        )
        self.gauges: dict[str, float] = {}


# ---- the engine thread ----------------------------------------------------------------------


class _Tracked:
    """What the engine thread remembers about one engine request."""

    def __init__(self, sink, arrival: float):
        self.sink = sink  # callable(item) run on the event loop thread
        self.arrival = arrival
        self.first_token: float | None = None
        self.num_tokens = 0


class EngineLoop:
    """Owns the engine on one thread; everything else reaches it through ``submit``/``abort``."""

    def __init__(self, engine, max_queue: int = DEFAULT_MAX_QUEUE):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = _Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._publish()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request_id: str, prompt_ids: list[int], params, sink):
        """Queue an add; the returned future fails with ValueError (bad request) or _QueueFull."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", request_id, prompt_ids, params, sink, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- on the engine thread --

    def _run(self) -> None:
        last_step = time.monotonic()
        while not self._stop:
            self._drain(block=not self.engine.has_unfinished_requests())
            if self._stop:
                break
            if time.monotonic() - last_step > _KEEP_ALIVE_S:
                self.engine.keep_alive()
                last_step = time.monotonic()
            if self.engine.has_unfinished_requests():
                last_step = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as e:  # keep serving: fail the requests in flight
                    logger.exception("engine step failed")
                    self._fail_all(e)
                    continue
                self._deliver(outputs)
            self._publish()
        self._fail_all(RuntimeError("the server is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is not None:
                self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd) -> None:
        if cmd[0] == "abort":
            if self._tracked.pop(cmd[1], None) is not None:
                self.engine.abort_request(cmd[1])
                self._count_finished("abort")
            return
        _, request_id, prompt_ids, params, sink, fut = cmd
        if not fut.set_running_or_notify_cancel():
            return
        if len(self.engine.scheduler.waiting) >= self.max_queue:
            fut.set_exception(_QueueFull(f"{self.max_queue} requests are already waiting"))
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except ValueError as e:
            fut.set_exception(e)
            return
        self._tracked[request_id] = _Tracked(sink, time.monotonic())
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(prompt_ids)
        fut.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        m = self.metrics
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            num = sum(len(c.token_ids) for c in out.outputs)
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            with m.lock:
                m.generation_tokens += num - t.num_tokens
                if t.first_token is None and num:
                    t.first_token = now
                    m.ttft.observe(now - t.arrival)
                if out.finished:
                    if longest > 1:
                        m.tpot.observe((now - t.first_token) / (longest - 1))
                    for c in out.outputs:
                        reason = c.finish_reason or "abort"
                        m.requests_finished[reason] = m.requests_finished.get(reason, 0) + 1
            t.num_tokens = num
            if out.finished:
                del self._tracked[out.request_id]
            t.sink(out)

    def _count_finished(self, reason: str) -> None:
        with self.metrics.lock:
            fin = self.metrics.requests_finished
            fin[reason] = fin.get(reason, 0) + 1

    def _fail_all(self, error: Exception) -> None:
        for request_id, t in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            t.sink(error)
        self._tracked.clear()
        self._publish()

    def _publish(self) -> None:
        sched, st = self.engine.scheduler, self.engine.get_stats()
        gauges = {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "num_requests_swapped": len(sched.swapped),
            "kv_blocks_total": st.num_blocks_total,
            "kv_blocks_used": st.num_blocks_used,
            "kv_blocks_usage_ratio": st.num_blocks_used / max(st.num_blocks_total, 1),
            "prefix_cache_hit_rate": st.prefix_cache_hit_rate,
            "num_preemptions": st.num_preemptions,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
        }
        with self.metrics.lock:
            self.metrics.gauges = gauges

    def render_metrics(self) -> str:
        m = self.metrics
        with m.lock:
            g = dict(m.gauges)
            lines: list[str] = []

            def metric(name, kind, help_, value, labels=""):
                lines.extend(
                    [
                        f"# HELP pagedjax_{name} {help_}",
                        f"# TYPE pagedjax_{name} {kind}",
                        f"pagedjax_{name}{labels} {value}",
                    ]
                )

            metric("num_requests_running", "gauge", "Requests running.", g["num_requests_running"])
            metric("num_requests_waiting", "gauge", "Requests waiting.", g["num_requests_waiting"])
            metric("num_requests_swapped", "gauge", "Requests swapped.", g["num_requests_swapped"])
            metric("kv_blocks_total", "gauge", "Allocatable KV blocks.", g["kv_blocks_total"])
            metric("kv_blocks_used", "gauge", "KV blocks in use.", g["kv_blocks_used"])
            metric("kv_cache_usage_ratio", "gauge", "Used / total.", g["kv_blocks_usage_ratio"])
            metric("prefix_cache_hit_rate", "gauge", "Prefix hits.", g["prefix_cache_hit_rate"])
            metric("num_preemptions_total", "counter", "Preemptions.", g["num_preemptions"])
            metric(
                "prefix_cache_queries_total",
                "counter",
                "Prefix lookups.",
                g["prefix_cache_queries"],
            )
            metric("prefix_cache_hits_total", "counter", "Prefix hits.", g["prefix_cache_hits"])
            metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", m.prompt_tokens)
            metric("generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens)
            lines += [
                "# HELP pagedjax_request_success_total Finished sequences by finish reason.",
                "# TYPE pagedjax_request_success_total counter",
            ]
            for reason, count in sorted(m.requests_finished.items()):
                lines.append(
                    f'pagedjax_request_success_total{{finished_reason="{reason}"}} {count}'
                )
            lines += m.ttft.render() + m.tpot.render()
        return "\n".join(lines) + "\n"


# ---- the app --------------------------------------------------------------------------------


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
    served_model_name: str,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app over ``engine``; the engine thread starts and stops with the app."""
    loop_owner = EngineLoop(engine, max_queue=max_queue)
    tokenizer = copy.deepcopy(engine.tokenizer)  # the handlers' own: tokenizers aren't shareable
    max_model_len = engine.config.scheduler.max_model_len
    vocab = engine.model_config.vocab_size
    created = int(time.time())
    counter = itertools.count()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        loop_owner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop_owner.stop)

    app = FastAPI(title="pagedjax", lifespan=lifespan)
    app.state.engine_loop = loop_owner

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

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise APIError(
                413, f"request body over {max_body_bytes} bytes", "invalid_request_error"
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(
                    413, f"request body over {max_body_bytes} bytes", "invalid_request_error"
                )
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad_request(f"the body is not valid JSON: {e}") from None

    def parse(model_cls, data):
        if not isinstance(data, dict):
            raise _bad_request("the body must be a JSON object")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise _bad_request(f"{loc}: {err['msg']}", param=loc) from None
        if req.model != served_model_name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {served_model_name!r}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return req

    def sampling_params(req, prompt_len: int, max_tokens, logprobs) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(max_model_len - prompt_len, 1)
        kwargs = dict(
            n=req.n,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise _bad_request(str(e)) from None

    def check_prompt(ids: list[int]) -> None:
        if not ids:
            raise _bad_request("the prompt is empty", "prompt")
        if len(ids) >= max_model_len:
            raise _bad_request(
                f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and leaves no room to generate",
                "prompt",
                "context_length_exceeded",
            )
        for t in ids:
            if not 0 <= t < vocab:
                raise _bad_request(f"token id {t} is outside the vocabulary [0, {vocab})", "prompt")

    def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
        if tokenizer is None:
            raise _bad_request("this model has no tokenizer; send prompts as token ids", "prompt")
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def token_str(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    async def start(request: Request, prompts: list[list[int]], params: SamplingParams) -> _Job:
        job = _Job(asyncio.get_running_loop())
        base = f"{next(counter)}-{uuid.uuid4().hex[:8]}"
        try:
            for i, ids in enumerate(prompts):
                rid = f"{base}-{i}"
                fut = loop_owner.submit(rid, ids, params, job.sink)
                job.request_ids.append(rid)
                await asyncio.wrap_future(fut)
        except BaseException as e:
            for rid in job.request_ids:
                loop_owner.abort(rid)
            if isinstance(e, _QueueFull):
                raise APIError(503, f"server busy: {e}", "server_error", "queue_full") from None
            if isinstance(e, ValueError):
                raise _bad_request(str(e)) from None
            raise
        return job

    async def next_output(request: Request, job: _Job) -> RequestOutput | None:
        """The next output, or None if the client went away (its requests are then aborted)."""
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), _POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if isinstance(item, Exception):
                raise APIError(500, f"the engine failed: {item}", "server_error")
            if item.finished:
                job.finished.add(item.request_id)
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

    # -- logprobs in the two shapes OpenAI uses --

    def completion_logprobs(token_ids, logprobs, k: int, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            s = token_str(tid)
            tokens.append(s)
            token_lps.append(lp.get(tid))
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            tops.append({token_str(t): v for t, v in top} if k else None)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(token_ids, logprobs, k: int) -> dict:
        content = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            s = token_str(tid)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                {
                    "token": s,
                    "logprob": lp.get(tid),
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": token_str(t), "logprob": v, "bytes": list(token_str(t).encode())}
                        for t, v in top
                    ],
                }
            )
        return {"content": content}

    # -- the shared generation driver: final choices or streamed deltas --

    async def run(request, req, prompts, params, chat: bool, k_logprobs: int | None):
        job = await start(request, prompts, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        kind = "chat.completion" if chat else "text_completion"
        now = int(time.time())
        index_of = {r: i for i, r in enumerate(job.request_ids)}
        n = params.n
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            gen = stream(request, job, rid, now, index_of, n, params, chat, k_logprobs)
            gen = stream_with_usage(gen, job, rid, now, prompts, include_usage, chat)
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
        choices, generated = [], 0
        for r in job.request_ids:
            for c in finals[r].outputs:
                index = index_of[r] * n + c.index
                generated += len(c.token_ids)
                lp = None
                if k_logprobs is not None and c.logprobs is not None:
                    lp = (
                        chat_logprobs(c.token_ids, c.logprobs, k_logprobs)
                        if chat
                        else completion_logprobs(c.token_ids, c.logprobs, k_logprobs, 0)
                    )
                choice = {"index": index, "logprobs": lp, "finish_reason": c.finish_reason}
                if chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        body = {
            "id": rid,
            "object": kind,
            "created": now,
            "model": served_model_name,
            "choices": choices,
            "usage": usage(prompts, generated),
        }
        return JSONResponse(body)

    async def stream(request, job, rid, now, index_of, n, params, chat, k_logprobs):
        kind = "chat.completion.chunk" if chat else "text_completion"
        hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be forming
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        text_offset: dict[int, int] = {}

        def chunk(index, text, finish, lp, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            body = {
                "id": rid,
                "object": kind,
                "created": now,
                "model": served_model_name,
                "choices": [choice],
            }
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                for r in job.request_ids:
                    for i in range(n):
                        yield chunk(index_of[r] * n + i, "", None, None, first=True)
            while not job.done:
                out = await next_output(request, job)
                if out is None:
                    return
                for c in out.outputs:
                    index = index_of[out.request_id] * n + c.index
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
                            lp = chat_logprobs(new_ids, new_lps, k_logprobs)
                        else:
                            off = text_offset.get(index, 0)
                            lp = completion_logprobs(new_ids, new_lps, k_logprobs, off)
                            text_offset[index] = off + sum(len(s) for s in lp["tokens"])
                    text = c.text[start_t:end_t]
                    sent_text[index], sent_tokens[index] = end_t, len(c.token_ids)
                    job.generated += len(new_ids)
                    if finish:
                        done.add(index)
                    if text or lp or finish:
                        yield chunk(index, text, finish, lp)
        finally:
            abort_unfinished(job)

    async def stream_with_usage(gen, job, rid, now, prompts, include_usage, chat):
        try:
            async for piece in gen:
                yield piece
        finally:
            await gen.aclose()
        if not job.done:
            return
        if include_usage:
            body = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": now,
                "model": served_model_name,
                "choices": [],
                "usage": usage(prompts, job.generated),
            }
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    # -- routes --

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            loop_owner.render_metrics(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "pagedjax",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        req = parse(CompletionRequest, await read_json(request))
        p = req.prompt
        if isinstance(p, str):
            prompts = [tokenize(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [tokenize(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            prompts = [list(p)]
        if req.echo:
            raise _bad_request("echo is not supported", "echo")
        for ids in prompts:
            check_prompt(ids)
        params = sampling_params(req, max(len(x) for x in prompts), req.max_tokens, req.logprobs)
        return await run(request, req, prompts, params, chat=False, k_logprobs=req.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        req = parse(ChatRequest, await read_json(request))
        if tokenizer is None or tokenizer.chat_template is None:
            raise _bad_request("this model's tokenizer has no chat template")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(
                    part.get("text", "") for part in content if part.get("type") == "text"
                )
            messages.append({"role": m.role, "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:
            raise _bad_request(f"the chat template failed on these messages: {e}") from None
        ids = tokenize(text, add_special_tokens=False)
        check_prompt(ids)
        max_tokens = req.max_completion_tokens or req.max_tokens
        k = None
        if req.logprobs:
            k = req.top_logprobs or 0
        elif req.top_logprobs:
            raise _bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        params = sampling_params(req, len(ids), max_tokens, k)
        return await run(request, req, [ids], params, chat=True, k_logprobs=k)

    return app


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    **llm_kwargs,
) -> None:
    """Load the model and serve it until interrupted."""
    import uvicorn

    from models.loader import default_model_path
    from pagedjax import LLM

    model = model or default_model_path()
    llm = LLM(model, **llm_kwargs)
    if not llm.engine.is_driver:  # multi-process: process 0 serves; this one replays its steps
        llm.engine.follow()
        llm.close()
        return
    app = None
    try:
        app = build_app(
            llm.engine,
            served_model_name or model,
            api_key=api_key,
            max_queue=max_queue,
            max_body_bytes=max_body_bytes,
        )
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        if app is not None and app.state.engine_loop.is_running:  # a step outlived shutdown
            logger.warning("the engine thread is still stepping; leaving the engine open")
        else:
            llm.close()  # in a multi-process run this stops the followers
