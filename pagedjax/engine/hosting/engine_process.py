"""The engine in a process of its own (vLLM V1's EngineCoreProc): ``pagedjax serve
--engine-process``. The API server process parses, tokenizes, checks admission and builds
responses; this process loads the model, owns the device and runs the engine loop, so that none of
the server's Python work holds the GIL the engine steps need.

Three threads here: the main thread reads commands from the API process's pipe (add, abort, a
named command, a metrics read, start, stop) and hands them to the engine loop (engine_loop.py,
the same loop an in-thread server runs); the engine thread steps; the sender thread pickles and
sends what each pass of the loop produced (its outputs, add and command results) as one message,
so that a step's outputs cross once, not once per token. The API side is engine_client.py.

Messages, API -> engine: ("add", [(rid, ids), ...], params, lora, priority) (one HTTP
request's prompts, taken by the engine between the same two steps), ("abort", rid), ("command",
cid, name, args), ("metrics", cid), ("start", model_name), ("stop",). Engine -> API: ("ready",
ServingInfo) or ("follower", None) or ("failed", message) once; then ("pass", [(kind, key,
payload)]), ("metrics", cid, text) and ("stopped",) last. A pass's entries: ("output", rid,
RequestOutput | OutputDelta | Exception) (a request's first output whole, then what changed:
output_delta.py), ("added", rid, error | None), ("result", cid, (error | None, value)). A command
that arrives before ("start", ...) (--lora-modules, while the app is built) runs at once: nothing
steps yet.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading

from pagedjax.engine.client import ENGINE_COMMANDS, QueueFull
from pagedjax.engine.hosting.engine_loop import EngineLoop, run_command
from pagedjax.engine.hosting.output_delta import OutputEncoder
from pagedjax.engine.hosting.startup import EngineOptions, start_engine

logger = logging.getLogger("pagedjax.api_server")


@dataclasses.dataclass
class ServingInfo:
    """What the API process needs of the engine, without its model: the tokenizer, the configs
    and the admission limits (engine_client.EngineProcess serves them as an EngineClient)."""

    tokenizer: object
    config: object  # EngineConfig
    model_config: object
    capacity: object  # input_processor.Capacity
    eos_token_ids: object
    default_sampling_params: dict


def serving_info(engine) -> ServingInfo:
    return ServingInfo(
        tokenizer=engine.tokenizer,
        config=engine.config,
        model_config=engine.model_config,
        capacity=engine.input_processor.capacity,
        eos_token_ids=engine.eos_token_ids,
        default_sampling_params=engine.default_sampling_params,
    )


@dataclasses.dataclass(frozen=True)
class RemoteError:
    """An exception as it crosses the pipe: its kind (``value``, ``queue_full``, ``other``) and
    its message (an engine's exception types need not pickle)."""

    kind: str
    message: str

    @classmethod
    def of(cls, e: BaseException) -> RemoteError:
        if isinstance(e, QueueFull):
            return cls("queue_full", str(e))
        return cls("value" if isinstance(e, ValueError) else "other", str(e))

    def exception(self) -> Exception:
        if self.kind == "queue_full":
            return QueueFull(self.message)
        return ValueError(self.message) if self.kind == "value" else RuntimeError(self.message)


class EngineCore:
    """The engine loop fed from a pipe and answering into another. ``flush`` is the loop's
    ``after_pass``: what a pass of the loop produced goes out as one message."""

    def __init__(self, conn_out):
        self._conn_out = conn_out
        self._pass: list[tuple] = []  # what this pass of the loop produced
        self._pass_lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="pagedjax-send", daemon=True)
        self._sender.start()
        self.loop: EngineLoop | None = None

    # -- the main thread: commands from the API process --

    def serve(self, loop: EngineLoop, conn_in) -> None:
        """Apply the API process's commands to ``loop`` until it says stop or goes away."""
        self.loop = loop
        while True:
            try:
                msg = conn_in.recv()
            except (EOFError, OSError):  # the API process is gone: nobody reads the outputs
                logger.warning("the API server process went away; the engine stops")
                msg = ("stop",)
            if msg[0] == "stop":
                self.loop.stop()
                self._outbox.put(("stopped",))
                self._outbox.put(None)
                self._sender.join(timeout=30)
                return
            self._apply(msg)

    def _apply(self, msg) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:])
        elif kind == "abort":
            self.loop.abort(msg[1])
        elif kind == "command":
            self._command(*msg[1:])
        elif kind == "metrics":
            self._outbox.put(("metrics", msg[1], self.loop.metrics.render()))
        elif kind == "start":
            if len(msg) > 1:  # the served model's name, the vllm: series' label
                self.loop.metrics.model_name = msg[1]
            self.loop.start()
        else:
            logger.error("unknown message from the API server process: %r", kind)

    def _command(self, cid: int, name: str, args: tuple) -> None:
        """Run a named command between steps; before the loop starts (the server's start-up:
        --lora-modules) nothing steps, so it runs here and now."""
        if name not in ENGINE_COMMANDS:
            error = RemoteError("value", f"unknown engine command {name!r}")
            self._outbox.put(("pass", [("result", cid, (error, None))]))
        elif not self.loop.is_running:
            try:
                result = (None, run_command(self.loop.engine, name, args))
            except Exception as e:
                result = (RemoteError.of(e), None)
            self._outbox.put(("pass", [("result", cid, result)]))
        else:
            fut = self.loop.command(name, *args)
            self._when_done(fut, lambda f: ("result", cid, _outcome(f)))

    def _add(self, adds: list[tuple[str, list[int]]], params, lora, priority: int = 0) -> None:
        try:
            self._compile_grammar(params)
        except ValueError as e:
            self._outbox.put(("pass", [("added", rid, RemoteError.of(e)) for rid, _ in adds]))
            return
        requests = [(rid, ids, self._sink(rid)) for rid, ids in adds]
        futs = self.loop.submit(requests, params, lora, priority)
        for (rid, _), fut in zip(adds, futs, strict=True):
            self._when_done(fut, lambda f, rid=rid: ("added", rid, _outcome(f)[0]))

    def _sink(self, rid: str):
        """Where the engine thread hands request ``rid``'s outputs: they cross as deltas
        (output_delta.py), with this pass's other entries."""
        encoder = OutputEncoder()

        def sink(item):  # on the engine thread
            if isinstance(item, BaseException):
                item = RemoteError.of(item).exception()
            else:
                item = encoder.encode(item)
            self._note(("output", rid, item))

        return sink

    def _when_done(self, fut, entry) -> None:
        """Send ``entry(fut)`` once the engine thread has settled ``fut``: with that pass's
        outputs, or now if it was settled before the callback was attached (the pass that
        settled it has been sent already)."""
        fut.add_done_callback(lambda f: self._note(entry(f)))
        if fut.done():
            self.flush()

    def _compile_grammar(self, params) -> None:
        """A constraint arrives as its text (engine_client strips the compiled grammar, which
        carries the whole tokenizer): compile it here, with its first mask, off the engine
        thread (cached: a constraint seen before costs a lookup)."""
        constraint = getattr(params, "structured_outputs", None)
        if constraint is not None:
            self.loop.compile_grammar(constraint).first_mask()

    # -- the engine thread and the sender --

    def _note(self, entry: tuple) -> None:
        with self._pass_lock:
            self._pass.append(entry)

    def flush(self) -> None:
        with self._pass_lock:
            batch, self._pass = self._pass, []
        if batch:
            self._outbox.put(("pass", batch))

    def _send_all(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn_out.send(msg)
            except (OSError, ValueError):  # the API process is gone
                return
            except Exception:  # e.g. an output that does not pickle: its request must not hang
                logger.exception("could not send %s to the API server process", msg[0])


def _outcome(fut) -> tuple[RemoteError | None, object]:
    e = fut.exception()
    return (RemoteError.of(e), None) if e is not None else (None, fut.result())


def engine_main(options: EngineOptions, conn_in, conn_out) -> None:
    """The engine process: load, compile what the server needs before it answers, say ready,
    then serve the API process's commands. Signals are the API process's: it stops this one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pagedjax.utils.log_setup import log_to_stderr

    log_to_stderr(options.log_level)
    core = EngineCore(conn_out)
    try:
        loop = start_engine(options, after_pass=core.flush)
    except BaseException as e:
        logger.exception("the engine process could not start")
        conn_out.send(("failed", f"{type(e).__name__}: {e}"))
        return
    if loop is None:  # multi-process: process 0 serves; this one has replayed its steps
        conn_out.send(("follower", None))
        return
    conn_out.send(("ready", serving_info(loop.engine)))
    core.serve(loop, conn_in)
    loop.close()
