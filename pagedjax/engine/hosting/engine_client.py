"""The API server's side of an engine in another process (vLLM V1's AsyncLLM over its
EngineCoreClient): ``EngineProcess`` starts the engine process (engine_process.py) and is an
EngineClient (engine/client.py), as the in-thread EngineLoop is: ``start``, ``stop``,
``is_running``, ``submit``, ``abort``, ``command``, ``metrics``, and, from the ServingInfo the
engine sent when it was ready, what it serves (tokenizer, configs, limits), its admission check
and a grammar compiler, with no model and no device in this process.

A reader thread takes the engine's messages (a pass of the loop at a time) and hands each output
to its request's sink, as the engine thread does in-thread. An engine process that dies makes
``is_running`` false, which the handlers and /health already turn into their errors.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import itertools
import logging
import multiprocessing
import threading

from pagedjax.engine.client import EngineClient, check_command
from pagedjax.engine.hosting.engine_process import ServingInfo, engine_main
from pagedjax.engine.hosting.output_delta import OutputDecoder
from pagedjax.engine.hosting.startup import EngineOptions
from pagedjax.engine.input_processor import InputProcessor
from pagedjax.outputs import token_texts

logger = logging.getLogger("pagedjax.api_server")

_STOP_S = 60.0  # how long stop() waits for the engine process to finish its requests and exit


class EngineProcess(EngineClient):
    """The engine process and the pipes to it; the handlers' engine client once ``wait_ready``
    has returned True."""

    def __init__(self, options: EngineOptions):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold jax
        to_engine_recv, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, from_engine_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=engine_main,
            args=(options, to_engine_recv, from_engine_send),
            name="pagedjax-engine-core",
            daemon=True,
        )
        self.process.start()
        to_engine_recv.close()  # this process keeps only its ends: EOF when the other side dies
        from_engine_send.close()
        self.metrics = RemoteMetrics(self)
        self._send_lock = threading.Lock()
        self._sinks: dict[str, tuple[object, OutputDecoder]] = {}  # a request's sink, decoder
        self._adds: dict[str, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._started = False
        self._alive = True  # until the engine process is seen gone
        self._token_text = None  # a token's text, for prompt logprobs (once the engine is ready)
        self.info: ServingInfo | None = None  # what the engine serves (once it is ready)
        self._input_processor: InputProcessor | None = None  # its admission check, here

    def wait_ready(self) -> bool:
        """Block until the engine has loaded and compiled what it needs before answering; False
        for a follower of a multi-process run (which serves nothing: ``join`` it). RuntimeError
        if the engine process failed to start."""
        try:
            kind, payload = self._from_engine.recv()
        except (EOFError, OSError):
            self.process.join(timeout=10)
            raise RuntimeError(
                f"the engine process exited (code {self.process.exitcode}) before it was ready"
            ) from None
        if kind == "failed":
            raise RuntimeError(f"the engine process could not start: {payload}")
        if kind == "ready":
            self.info = payload
            self._input_processor = InputProcessor(payload.capacity, payload.tokenizer)
            if payload.tokenizer is not None:
                self._token_text = token_texts(copy.deepcopy(payload.tokenizer))
        self._reader = threading.Thread(target=self._read, name="pagedjax-engine-out", daemon=True)
        self._reader.start()
        return kind == "ready"

    def join(self) -> None:
        """Wait for the engine process to end (a follower's, which serves nothing here)."""
        self.process.join()

    # -- what it serves, and request checks (EngineClient) --

    @property
    def tokenizer(self):
        return self.info.tokenizer

    @property
    def model_config(self):
        return self.info.model_config

    @property
    def config(self):
        return self.info.config

    @property
    def eos_token_ids(self):
        return self.info.eos_token_ids

    @property
    def default_sampling_params(self) -> dict:
        return self.info.default_sampling_params

    def check_request(self, prompt_token_ids: list[int], params) -> None:
        """The engine's admission check, on the same limits (LLMEngine.check_request)."""
        self._input_processor.check(prompt_token_ids, params)

    def compile_grammar(self, constraint):
        """Compiled here for the handlers' checks; sent as text, the engine compiles it again
        (``_without_compiled``)."""
        return self._input_processor.grammars.compile(constraint)

    # -- running requests (EngineClient) --

    def start(self) -> None:
        """The server is about to answer: the engine thread and its background compile start."""
        from pagedjax.engine.hosting.startup import freeze_startup_objects

        freeze_startup_objects()  # this process's start-up objects, as the engine's are there
        self._send(("start", self.metrics.model_name))
        self._started = True

    @property
    def is_running(self) -> bool:
        return self._started and self._alive and self.process.is_alive()

    def stop(self) -> None:
        """Stop the engine (requests in flight get the shutdown error) and wait for its process."""
        self._send_unless_gone(("stop",))
        if self._reader is not None:
            self._reader.join(timeout=_STOP_S)
        self.process.join(timeout=_STOP_S)
        if self.process.is_alive():
            logger.warning("the engine process did not stop; terminating it")
            self.process.terminate()
            self.process.join(timeout=10)

    def close(self) -> None:
        """Stop the engine process if it still runs (the app's shutdown stops it first)."""
        if self.process.is_alive():
            self.stop()

    def submit(self, requests: list[tuple], params, lora_request=None, priority: int = 0) -> list:
        """As EngineLoop.submit, in one message: the futures fail with ValueError, QueueFull or
        RuntimeError."""
        futs = []
        for request_id, _, sink in requests:
            self._sinks[request_id] = (sink, OutputDecoder(self._token_text))
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._adds[request_id] = fut
            futs.append(fut)
        adds = [(request_id, prompt_ids) for request_id, prompt_ids, _ in requests]
        msg = ("add", adds, _without_compiled(params), lora_request, priority)
        self._send_unless_gone(msg)  # gone: the handler sees is_running false, as in-thread
        return futs

    def abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)  # nothing more reaches its handler, as in-thread
        self._send_unless_gone(("abort", request_id))

    def command(self, name: str, *args):
        """As EngineLoop.command: the engine's command ``name`` run between steps."""
        check_command(name)
        return self._ask(("command", name, args))

    # -- talking to the engine process --

    def _send(self, msg) -> None:
        with self._send_lock:
            self._to_engine.send(msg)

    def _send_unless_gone(self, msg) -> None:
        try:
            if self._alive:
                self._send(msg)
        except OSError:  # the engine process died; the reader thread is about to say so
            pass

    def _ask(self, msg) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._ids)
        self._calls[cid] = fut
        if not self._alive:
            fut.set_exception(RuntimeError("the engine process has stopped"))
            return fut
        self._send((msg[0], cid, *msg[1:]))
        return fut

    def _read(self) -> None:
        while True:
            try:
                msg = self._from_engine.recv()
            except (EOFError, OSError):
                logger.error("the engine process has exited (code %s)", self.process.exitcode)
                break
            if msg[0] == "stopped":
                break
            if msg[0] == "metrics":
                self._settle(self._calls.pop(msg[1], None), None, msg[2])
                continue
            for entry in msg[1]:
                self._deliver(*entry)
        self._alive = False
        for fut in list(self._calls.values()):
            self._settle(fut, RuntimeError("the engine process has stopped"), None)

    def _deliver(self, kind: str, key, payload) -> None:
        if kind == "output":
            entry = self._sinks.get(key)
            if entry is None:  # aborted here already
                return
            sink, decoder = entry
            if not isinstance(payload, Exception):
                payload = decoder.decode(payload)
            if isinstance(payload, Exception) or payload.finished:
                self._sinks.pop(key, None)  # an abort on the event loop may have taken it
            try:
                sink(payload)
            except Exception:  # the event loop is gone (shutdown): nobody is waiting
                logger.warning("could not deliver the output of %s", key)
        elif kind == "added":
            if payload is not None:
                self._sinks.pop(key, None)
            error = None if payload is None else payload.exception()
            self._settle(self._adds.pop(key, None), error, None)
        elif kind == "result":
            error, value = payload
            self._settle(
                self._calls.pop(key, None), None if error is None else error.exception(), value
            )

    @staticmethod
    def _settle(fut, error, value) -> None:
        if fut is None or fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


class RemoteMetrics:
    """/metrics as the engine process renders it (its counters, stats and start figures)."""

    def __init__(self, process: EngineProcess, timeout_s: float = 10.0):
        self._process = process
        self._timeout_s = timeout_s
        self._last = b""
        self.model_name = "pagedjax"  # the vllm: series' label, sent to the engine at start

    def render(self) -> bytes:
        """The engine process's exposition now; the last one read if it has stopped."""
        with contextlib.suppress(RuntimeError, OSError, concurrent.futures.TimeoutError):
            self._last = self._process._ask(("metrics",)).result(timeout=self._timeout_s)
        return self._last


def _without_compiled(params):
    """``params`` with its structured-output constraint as text only: a compiled grammar pickles
    with the whole tokenizer; the engine process compiles it again (engine_process.py)."""
    constraint = getattr(params, "structured_outputs", None)
    if constraint is None or constraint.compiled is None:
        return params
    params = copy.copy(params)
    constraint = copy.copy(constraint)
    object.__setattr__(constraint, "compiled", None)
    object.__setattr__(params, "structured_outputs", constraint)
    return params
