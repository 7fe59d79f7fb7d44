"""The engine on a thread of the server's process: ``EngineLoop``, an EngineClient
(engine/client.py) over an LLMEngine. The engine thread applies queued commands (add, abort),
runs ``engine.step()`` and hands each RequestOutput to the sink of the HTTP request waiting for
it. Handlers never touch the engine's state; they talk to it through ``submit`` and ``abort``,
and read what it serves (tokenizer, configs, limits) and check requests through the client.

A request that fails inside the engine comes back as its own finished output with ``error`` set;
if ``step()`` itself raises, every request in flight gets the exception and the thread goes on
serving. Nothing a request does ends the thread.

LoRA adapters are read from disk and checked on a reader thread of the loop's own (one thread:
reads queue behind it), never on the engine thread, and installed in the engine's host cache
between steps: ``command("add_lora", ...)`` (/v1/load_lora_adapter) and a request naming an
adapter that is not in the host cache (``submit``). A request whose adapter must be re-read when
it is admitted, after it left the host cache, reads it there (the scheduler's, on this thread).

A server's start (engine/hosting/startup.py) rides on the loop: ``start`` marks the moment
the server answers and starts the background compile of the programs not yet compiled, which
runs beside the engine thread (a step that needs one of them compiles it itself); ``stop`` ends
the background compile before the engine thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time

from pagedjax.engine.client import DEFAULT_MAX_QUEUE, EngineClient, QueueFull, check_command
from pagedjax.metrics.server import ServerMetrics
from pagedjax.outputs import RequestOutput

logger = logging.getLogger("pagedjax.api_server")

# Multi-process: how often an idle driver pings its followers, which wait for it in a collective
# (a backend may time out a wait of hours).
_KEEP_ALIVE_S = 10.0


def run_command(engine, name: str, args: tuple):
    """The engine's command ``name`` (one of engine/client.py's ENGINE_COMMANDS) on ``args``,
    here and now (the engine thread, or before it starts)."""
    lora = engine.lora
    commands = {"add_lora": lora.add_lora, "remove_lora": lora.remove_lora}
    return commands[name](*args)


# ---- the thread -----------------------------------------------------------------------------


class _Tracked:
    """What the engine thread remembers about one engine request."""

    def __init__(self, sink, arrival: float, lora_name: str | None = None, params=None):
        self.sink = sink  # callable(item) that passes item to the event loop thread
        self.arrival = arrival
        self.lora_name = lora_name  # the LoRA adapter it runs under, if any
        self.first_token: float | None = None
        self.num_tokens = 0
        # its n (beam width) and max_tokens, for vLLM's request_params_* histograms
        self.n = getattr(params, "n", None) or getattr(params, "beam_width", 1)
        self.max_tokens = getattr(params, "max_tokens", 0)


class EngineLoop(EngineClient):
    """Owns the engine on one thread; everything else reaches it through ``submit``/``abort``.
    ``max_queue``: requests that may wait before an add fails with QueueFull. ``after_pass``:
    called on the engine thread after each pass of the loop (outputs handed to the sinks, stats
    published): an engine process sends what the pass produced in one message."""

    def __init__(self, engine, max_queue: int = DEFAULT_MAX_QUEUE, after_pass=None):
        self.engine = engine
        self.max_queue = max_queue
        self._after_pass = after_pass
        config = engine.config
        cache = config.cache
        self.metrics = ServerMetrics(config.scheduler.max_model_len, cache.block_size, cache)
        runner = engine.runner  # its counts also grow on a background compile's thread
        self.metrics.compile_counts = lambda: (runner.num_compilations, runner.compile_seconds)
        if engine.lora.enabled:
            self.metrics.max_loras = config.lora.max_loras
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._lora_reader: concurrent.futures.ThreadPoolExecutor | None = None
        self.startup = None  # a server's start (startup.Startup), when ``attach_startup`` ran
        self._publish()

    # ---- what it serves, and request checks (EngineClient) ------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def config(self):
        return self.engine.config

    @property
    def eos_token_ids(self):
        return self.engine.eos_token_ids

    @property
    def default_sampling_params(self) -> dict:
        return self.engine.default_sampling_params

    def check_request(self, prompt_token_ids: list[int], params) -> None:
        self.engine.check_request(prompt_token_ids, params)

    def compile_grammar(self, constraint):
        return self.engine.input_processor.grammars.compile(constraint)

    # ---- life ---------------------------------------------------------------------------------

    def attach_startup(self, startup) -> None:
        """Report ``startup`` (its figures join /metrics) and start its background compile when
        the loop starts."""
        self.startup = startup
        self.metrics.registry.register(startup)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()
        if self.startup is not None:
            self.startup.ready()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self.startup is not None:
            self.startup.stop()
        self._stop = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._lora_reader is not None:
            self._lora_reader.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Free the engine (in a multi-process run this stops the followers), unless a step
        outlived the shutdown."""
        if self.is_running:
            logger.warning("the engine thread is still stepping; leaving the engine open")
        else:
            self.engine.close()

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, requests: list[tuple], params, lora_request=None, priority: int = 0) -> list:
        """Queue the adds of ``requests`` ((request id, prompt ids, sink) each, all with
        ``params`` and ``priority``, under the LoRA adapter ``lora_request`` if given) as one
        command: the engine
        takes them between the same two steps, so that the prompts of one HTTP request are
        prefilled together, as ``LLM.generate``'s are. One future per request; each fails with
        ValueError (bad request), QueueFull, or whatever else add_request raised."""
        futs = [concurrent.futures.Future() for _ in requests]
        cmd = ("add", requests, params, futs, lora_request, None, priority)
        if not self.engine.lora.needs_read(lora_request):
            self._commands.put(cmd)
        else:  # read the adapter first, off the engine thread; install it with the adds
            self._reader().submit(self._read_then_add, cmd)
        return futs

    def _read_then_add(self, cmd) -> None:
        try:
            adapter = self.engine.lora.read(cmd[4])
        except Exception as e:  # this request's adapter: it fails alone
            for fut in cmd[3]:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(e)
            return
        self._commands.put((*cmd[:5], adapter, cmd[6]))

    def call(self, fn):
        """Run ``fn(engine)`` on the engine thread, between steps (e.g. loading a LoRA adapter);
        the returned future holds its result or exception. Before the loop starts (a server's
        start-up: --lora-modules) nothing steps: it runs here and now."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None:
            _settle_call(fut, fn, self.engine)
        else:
            self._commands.put(("call", fn, fut))
        return fut

    def command(self, name: str, *args):
        """Run the engine's command ``name`` (one of ENGINE_COMMANDS) on ``args`` between
        steps, as ``call`` does; the returned future holds its result or exception."""
        check_command(name)
        lora = self.engine.lora
        if name == "add_lora" and lora.enabled and self._thread is not None:
            return self._add_lora(lora, *args)
        return self.call(lambda engine: run_command(engine, name, args))

    def _add_lora(self, lora, request):
        """Read and check the adapter on the reader thread, then install it between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def read() -> None:
            try:
                adapter = lora.read(request)
            except Exception as e:
                fut.set_exception(e)
                return
            installed = self.call(lambda engine: lora.install(request, adapter))
            installed.add_done_callback(lambda done: _settle(fut, done))

        self._reader().submit(read)
        return fut

    def _reader(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._lora_reader is None:
            self._lora_reader = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pagedjax-lora-read"
            )
        return self._lora_reader

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- on the engine thread --

    def _run(self) -> None:
        last_step = time.monotonic()
        while not self._stop:
            try:
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stop:
                    break
                if time.monotonic() - last_step > _KEEP_ALIVE_S:
                    self.engine.keep_alive()
                    last_step = time.monotonic()
                if self.engine.has_unfinished_requests():
                    last_step = time.monotonic()
                    self._deliver(self.engine.step())
                    self._observe_step()
                self._publish()
            except Exception as e:  # keep serving: fail the requests in flight
                logger.exception("engine step failed")
                self.metrics.step_failures.inc()
                self._fail_all(e)
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
                self.metrics.finished("abort")
                self.metrics.vllm.finished_reason("abort")
            return
        if cmd[0] == "call":
            _, fn, fut = cmd
            _settle_call(fut, fn, self.engine)
            return
        _, requests, params, futs, lora, adapter, priority = cmd
        if adapter is not None:  # read on the reader thread for these requests
            try:
                self.engine.lora.install(lora, adapter)
            except Exception as e:
                for fut in futs:
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(e)
                return
        for (request_id, prompt_ids, sink), fut in zip(requests, futs, strict=True):
            self._add(request_id, prompt_ids, params, sink, fut, lora, priority)

    def _add(self, request_id, prompt_ids: list[int], params, sink, fut, lora, priority) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if self.engine.get_stats().num_requests_waiting >= self.max_queue:
            fut.set_exception(QueueFull(f"{self.max_queue} requests are already waiting"))
            return
        try:
            extra = {} if lora is None else {"lora_request": lora}
            if priority:
                extra["priority"] = priority
            self.engine.add_request(request_id, prompt_ids, params, **extra)
        except Exception as e:  # add_request leaves the engine untouched when it raises
            fut.set_exception(e)
            return
        name = None if lora is None else lora.lora_name
        self._tracked[request_id] = _Tracked(sink, time.monotonic(), name, params)
        self.metrics.admitted(len(prompt_ids))
        self.metrics.lora_request(name)
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
            m.lora_generation_tokens(t.lora_name, num - t.num_tokens)
            if t.first_token is None and num:
                # the engine's time: a request that asked for its final output alone has none before
                m.vllm.first_token(t, out, now)
                m.ttft.observe(t.first_token - t.arrival)
            if out.finished:
                if longest > 1:
                    m.tpot.observe((now - t.first_token) / (longest - 1))
                for c in out.outputs:
                    m.finished(c.finish_reason or "abort")
                m.vllm.finished(t, out, now)
                if out.error is not None:
                    m.request_errors.inc()
            t.num_tokens = num
            if out.finished:
                del self._tracked[out.request_id]
            self._send(out.request_id, t, out)

    def _observe_step(self) -> None:
        """The step's gaps between each request's tokens (vLLM's inter-token latencies)."""
        steps = getattr(self.engine, "steps", None)
        gaps = getattr(steps, "token_gaps", None)
        if gaps:
            self.metrics.vllm.token_gaps(gaps)

    @staticmethod
    def _send(request_id: str, t: _Tracked, item) -> None:
        try:
            t.sink(item)
        except Exception:  # the event loop is gone (shutdown): nobody is waiting
            logger.warning("could not deliver the output of %s", request_id)

    def _fail_all(self, error: Exception) -> None:
        for request_id, t in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            self._send(request_id, t, error)
        self._tracked.clear()
        try:
            self._publish()
        except Exception:
            logger.exception("could not read the engine's stats")

    def _publish(self) -> None:
        self.metrics.publish(self.engine.get_stats())
        if self.engine.lora.enabled:
            self.metrics.publish_lora(self.engine.lora.requests_info(self.engine.scheduler))
        if self._after_pass is not None:
            self._after_pass()


def _settle(fut: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
    """``fut`` takes ``done``'s result or exception."""
    if done.exception() is not None:
        fut.set_exception(done.exception())
    else:
        fut.set_result(done.result())


def _settle_call(fut: concurrent.futures.Future, fn, engine) -> None:
    """``fut`` takes ``fn(engine)``'s result or exception."""
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(fn(engine))
        except Exception as e:
            fut.set_exception(e)
