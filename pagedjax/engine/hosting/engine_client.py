"""The API server's side of an engine in another process (vLLM V1's AsyncLLM over its
EngineCoreClient): ``EngineProcess`` starts the engine process (engine_process.py) and stands
where the in-thread server's EngineLoop stands — ``start``, ``stop``, ``is_running``, ``submit``,
``abort``, ``command``, ``metrics`` — and ``RemoteEngine`` stands for the engine itself where the
server reads it before anything runs: its tokenizer, configs, admission check and grammar
compiler, with no model and no device in this process.

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

from pagedjax.engine.hosting.engine_loop import ENGINE_COMMANDS
from pagedjax.engine.hosting.engine_process import EngineOptions, ServingInfo, engine_main
from pagedjax.engine.hosting.output_delta import OutputDecoder
from pagedjax.engine.input_processor import InputProcessor
from pagedjax.outputs import token_texts

logger = logging.getLogger("pagedjax.api_server")

_STOP_S = 60.0  # how long stop() waits for the engine process to finish its requests and exit


class EngineProcess:
    """The engine process and the pipes to it; the handlers' engine loop."""

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

    def wait_ready(self) -> ServingInfo | None:
        """Block until the engine has loaded and compiled what it needs before answering; its
        ServingInfo, or None for a follower of a multi-process run (which serves nothing).
        RuntimeError if the engine process failed to start."""
        try:
            kind, payload = self._from_engine.recv()
        except (EOFError, OSError):
            self.process.join(timeout=10)
            raise RuntimeError(
                f"the engine process exited (code {self.process.exitcode}) before it was ready"
            ) from None
        if kind == "failed":
            raise RuntimeError(f"the engine process could not start: {payload}")
        if kind == "ready" and payload.tokenizer is not None:
            self._token_text = token_texts(copy.deepcopy(payload.tokenizer))
        self._reader = threading.Thread(target=self._read, name="pagedjax-engine-out", daemon=True)
        self._reader.start()
        return payload if kind == "ready" else None

    # -- the engine loop's interface --

    def start(self) -> None:
        """The server is about to answer: the engine thread and its background compile start."""
        from pagedjax.engine.hosting.startup import freeze_startup_objects

        freeze_startup_objects()  # this process's start-up objects, as the engine's are there
        self._send(("start",))
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

    def submit(self, requests: list[tuple], params, lora_request=None) -> list:
        """As EngineLoop.submit, in one message: the futures fail with ValueError, QueueFull or
        RuntimeError."""
        futs = []
        for request_id, _, sink in requests:
            self._sinks[request_id] = (sink, OutputDecoder(self._token_text))
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._adds[request_id] = fut
            futs.append(fut)
        adds = [(request_id, prompt_ids) for request_id, prompt_ids, _ in requests]
        msg = ("add", adds, _without_compiled(params), lora_request)
        self._send_unless_gone(msg)  # gone: the handler sees is_running false, as in-thread
        return futs

    def abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)  # nothing more reaches its handler, as in-thread
        self._send_unless_gone(("abort", request_id))

    def command(self, name: str, *args):
        """As EngineLoop.command: the engine's method ``name`` run between steps."""
        if name not in ENGINE_COMMANDS:
            raise ValueError(f"unknown engine command {name!r}; known: {sorted(ENGINE_COMMANDS)}")
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

    def render(self) -> bytes:
        """The engine process's exposition now; the last one read if it has stopped."""
        with contextlib.suppress(RuntimeError, OSError, concurrent.futures.TimeoutError):
            self._last = self._process._ask(("metrics",)).result(timeout=self._timeout_s)
        return self._last


class RemoteEngine:
    """The engine as the API process reads it: what build_app and the handlers use of an
    LLMEngine before and beside the engine loop, from the engine process's ServingInfo."""

    def __init__(self, info: ServingInfo, process: EngineProcess):
        self.engine_loop = process  # build_app serves through it
        self.tokenizer = info.tokenizer
        self.config = info.config
        self.model_config = info.model_config
        self.eos_token_ids = info.eos_token_ids
        self.default_sampling_params = info.default_sampling_params
        self.input_processor = InputProcessor(info.capacity, info.tokenizer)
        self.lora_enabled = info.config.lora is not None  # whether it serves LoRA adapters

    def check_request(self, prompt_token_ids: list[int], params) -> None:
        """The engine's admission check, on the same limits (LLMEngine.check_request)."""
        self.input_processor.check(prompt_token_ids, params)

    def add_lora(self, lora_request) -> bool:
        """Load an adapter in the engine process (--lora-modules at start); ValueError as the
        engine's."""
        return self.engine_loop.command("add_lora", lora_request).result()


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
