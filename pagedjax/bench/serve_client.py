"""The HTTP side of ``pagedjax bench serve``: one streamed request timed token by token, the probe
that finds which extra fields a server takes, and a workload sent at its arrival times.

Times are ``time.perf_counter()`` stamps taken when an event carrying text arrives: TTFT is the
first such event minus the send, ITL the gaps between such events (a server may pack several
tokens into one event, as vLLM's client also counts them), end-to-end latency the end of the
stream minus the send. A failure of any kind (HTTP status, a transport error, an error event in
the stream, a stream without text) ends that request with its message; it never stops the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np

from pagedjax.bench.serve_workload import BenchRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# Fields beyond OpenAI's that make lengths exact or usage reported; dropped if a server refuses.
OPTIONAL_FIELDS = ("min_tokens", "ignore_eos", "stream_options")
ERROR_TEXT_CHARS = 300


class ServerUnreachable(ValueError):
    """The probe could not connect at all (a ValueError: the CLI's usage-error exit)."""


@dataclasses.dataclass
class Target:
    """Where and how to send: the request body is built here."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    temperature: float = 0.0
    extra_body: dict = dataclasses.field(default_factory=dict)
    fields: tuple[str, ...] = OPTIONAL_FIELDS  # the optional fields this server takes

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        self.base_url = self.base_url.rstrip("/")

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: BenchRequest, fields: tuple[str, ...] | None = None) -> dict:
        fields = self.fields if fields is None else fields
        n = req.output_len
        body: dict = {"model": self.model, "temperature": self.temperature, "stream": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = n
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = n
        if "ignore_eos" in fields:
            body["ignore_eos"] = True
        if "min_tokens" in fields:
            body["min_tokens"] = n
        if "stream_options" in fields:
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        return body


@dataclasses.dataclass
class RequestResult:
    prompt_len: int  # as the workload's tokenizer counts the prompt text
    output_len: int  # requested
    success: bool = False
    error: str = ""
    ttft: float | None = None  # seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0  # end to end, seconds
    output_tokens: int | None = None  # the server's usage, else counted by the caller
    usage_prompt_tokens: int | None = None  # the server's count (with the chat template)
    text: str = ""
    start_time: float = 0.0  # time.perf_counter() at the send


def error_message(status: int, raw: bytes) -> str:
    """A short message for an HTTP error: OpenAI's error.message, FastAPI's detail, or the text."""
    text = raw.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    return f"HTTP {status}: {text.strip()[:ERROR_TEXT_CHARS]}"


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _stream_error(chunk: dict) -> str | None:
    err = chunk.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        err = err.get("message", json.dumps(err))
    return f"error event: {str(err)[:ERROR_TEXT_CHARS]}"


async def send(client, target: Target, req: BenchRequest) -> RequestResult:
    """One streamed request, timed; every failure is caught into ``RequestResult.error``."""
    res = RequestResult(req.prompt_len, req.output_len)
    parts: list[str] = []
    start = res.start_time = time.perf_counter()
    last = start
    try:
        async with client.stream(
            "POST", target.url, json=target.body(req), headers=target.headers
        ) as resp:
            if resp.status_code != 200:
                res.error = error_message(resp.status_code, await resp.aread())
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    res.error = f"an event that is not JSON: {data[:ERROR_TEXT_CHARS]}"
                    return res
                if not isinstance(chunk, dict):
                    continue
                if (err := _stream_error(chunk)) is not None:
                    res.error = err
                    return res
                now = time.perf_counter()
                if text := _chunk_text(chunk, target.chat):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    parts.append(text)
                if isinstance(usage := chunk.get("usage"), dict):
                    res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                    res.usage_prompt_tokens = usage.get("prompt_tokens")
    except Exception as e:  # transport errors, timeouts, broken streams: counted, never fatal
        res.error = f"{type(e).__name__}: {str(e)[:ERROR_TEXT_CHARS] or 'no message'}"
        return res
    res.latency = time.perf_counter() - start
    res.text = "".join(parts)
    if res.ttft is None:
        res.error = "the stream ended without any text"
        return res
    res.success = True
    return res


def make_client(concurrency: int | None, timeout_s: float):
    import httpx2

    conns = concurrency if concurrency else 1000
    return httpx2.AsyncClient(
        timeout=httpx2.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
        limits=httpx2.Limits(max_connections=conns, max_keepalive_connections=conns),
        trust_env=False,  # no proxy between the benchmark and a local server
    )


@dataclasses.dataclass
class ProbeResult:
    fields: tuple[str, ...]  # the optional fields the server took
    refused: dict[str, str]  # field -> the server's message refusing it
    note: str = ""  # a probe that failed for another reason


async def probe(client, target: Target, req: BenchRequest) -> ProbeResult:
    """Send ``req`` (shortened to 2 output tokens) with every optional field; drop each field the
    server's error names and retry. A server that cannot be reached raises ServerUnreachable."""
    import httpx2

    req = dataclasses.replace(req, output_len=2)
    fields, refused = list(OPTIONAL_FIELDS), {}
    while True:
        try:
            resp = await client.post(
                target.url, json=target.body(req, tuple(fields)), headers=target.headers
            )
        except httpx2.TransportError as e:
            raise ServerUnreachable(f"cannot reach {target.url}: {type(e).__name__}: {e}") from None
        if resp.status_code == 200:
            return ProbeResult(tuple(fields), refused)
        message = error_message(resp.status_code, resp.content)
        named = [f for f in fields if f in message]
        if not named or resp.status_code >= 500:
            return ProbeResult(tuple(fields), refused, f"the probe request failed: {message}")
        for f in named:
            fields.remove(f)
            refused[f] = message


async def run_requests(
    target: Target,
    requests: list[BenchRequest],
    arrivals: np.ndarray,
    *,
    max_concurrency: int | None,
    timeout_s: float,
    progress=None,
) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival offset (s), at most ``max_concurrency`` in flight; the
    results in workload order and the wall time from the first send to the last answer."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with make_client(max_concurrency, timeout_s) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = float(arrivals[i]) - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await send(client, target, requests[i])
            else:
                async with sem:
                    res = await send(client, target, requests[i])
            if progress is not None:
                progress.update(1)
            return res

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        return list(results), time.perf_counter() - start


async def warm_up(
    target: Target,
    requests: list[BenchRequest],
    num: int,
    max_concurrency: int | None,
    timeout_s: float,
) -> list[RequestResult]:
    """``num`` of ``requests`` (the first ones, again from the first if there are fewer) sent
    at once, at most ``max_concurrency`` in flight (vLLM's warm-up): what a row's batch sizes
    compile or allocate on first use is done before the row is timed."""
    chosen = [requests[i % len(requests)] for i in range(num)]
    arrivals = np.zeros(num)
    results, _ = await run_requests(
        target, chosen, arrivals, max_concurrency=max_concurrency, timeout_s=timeout_s
    )
    return results


async def probe_and_warm(
    target: Target, requests: list[BenchRequest], num_warmups: int, timeout_s: float
) -> tuple[ProbeResult, list[RequestResult]]:
    """The probe, then ``num_warmups`` requests one after another (the workload's first ones)."""
    async with make_client(1, timeout_s) as client:
        found = await probe(client, target, requests[0])
        target.fields = found.fields
        warm = [await send(client, target, requests[i % len(requests)]) for i in range(num_warmups)]
    return found, warm
