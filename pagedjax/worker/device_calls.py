"""A runner's device operations, one door: ``DeviceCalls.run``.

Each operation (a step, a block move, a slot write) runs here and, in a multi-process run
(``pagedjax.distributed``), on every follower too: the driver broadcasts it with its host arrays
and the followers, looping in ``follow``, replay it. The programs an operation compiles are
counted (per thread: a background compile counts its own), a compile after warm-up is logged
with what needed it, and before each step the process's compiled programs are held within the
kernel's memory-map limit (pagedjax/executables.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pagedjax import compilation, executables
from pagedjax.distributed import Channel

logger = logging.getLogger("pagedjax.worker.runner")


class DeviceCalls:
    """Runs a runner's device operations (``ops(name)``: the function behind one, None for a
    message that is not one), counts what they compile, replays them on a follower."""

    def __init__(self, ops: Callable[[str], Callable | None], channel: Channel | None = None):
        self.ops = ops
        self.channel = channel  # set in a multi-process run
        self.num_compilations = 0  # programs compiled because of these operations or warm-up
        self.compile_seconds = 0.0  # time spent tracing, lowering and compiling them
        self.warmed_up = False  # a warm-up compiled programs: a step that compiles is logged
        # (op, args, call start, return time, output) after each call: a probe timing dispatch
        self.observer: Callable | None = None
        self.guard = executables.guard()
        self._lock = threading.Lock()  # the engine thread and a background compile count

    def count(self, programs: int, seconds: float) -> None:
        """Add programs compiled (or loaded) and their seconds; safe from any thread."""
        with self._lock:
            self.num_compilations += programs
            self.compile_seconds += seconds

    def run(self, op: str, *args):
        """Run ``op`` here and, in a multi-process run, on every follower; counts the programs
        it compiles; then ``observer(op, args, start, returned, out)`` if one is set."""
        if op == "run_step":
            self.guard.check()  # between steps: no program of this thread is running
        if self.channel is not None:
            self.channel.send((op, args))
        compiles, seconds = compilation.this_thread()  # a background compile is not this op's
        start = time.perf_counter()
        try:
            out = self.ops(op)(*args)
        finally:
            now = compilation.this_thread()
            self.count(now[0] - compiles, now[1] - seconds)
            if now[0] > compiles and self.warmed_up:  # every step in flight waited for it
                logger.info(
                    "%s compiled %d program(s) on first use (%.2f s; warm-up had not): %s",
                    op,
                    now[0] - compiles,
                    now[1] - seconds,
                    describe(op, args),
                )
        if self.observer is not None:
            self.observer(op, args, start, time.perf_counter(), out)
        return out

    def follow(self):
        """Follower: replay the driver's device operations until a message that is not one
        (the caller's business, e.g. "stop"); returns that message as ``(op, payload)``."""
        while True:
            op, args = self.channel.recv()
            run = self.ops(op)
            if run is None:
                return op, args
            if op == "run_step":
                self.guard.check()
            try:
                run(*args)
            except Exception:  # the driver meets the same failure; its next message says more
                logger.exception("device operation %s failed on this follower", op)


def describe(op: str, args: tuple) -> str:
    """What a device operation ran, for a log line (a step: its layout and sampler variant)."""
    if op != "run_step":
        return op
    layout, sampling, drafts, score_chunks = args[1], args[2], args[3], args[5]
    out = (
        f"step t{layout.num_tokens} s{layout.num_seqs} b{layout.max_blocks} "
        f"q{layout.max_query_len}, {layout.num_logits} sampler rows"
    )
    if score_chunks:
        out += f", {len(score_chunks)} chunk(s) of prompt rows scored"
    if layout.sampling is not None:
        out += ", sampling in the step"
    if sampling is not None:
        out += f", sampler {sampling.variant}"
    if drafts is not None:
        out += ", verifying proposals"
    return out
