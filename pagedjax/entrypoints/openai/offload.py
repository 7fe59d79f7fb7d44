"""Work that must not hold the event loop: tokenizing prompts, rendering chat templates,
compiling grammars and building large responses run on a fixed number of threads, so that
/health and every other connection keep being served while one request's heavy part runs.

Three lanes, each a bounded pool, so that slow work never queues the quick work of others:
``light`` for ordinary requests, ``heavy`` for a request marked heavy (a large body, echo or
logprobs), ``grammar`` for compiling structured-output constraints (whose cost no size predicts).
Heavy work is CPU-bound and holds the GIL much of the time (a 200 KB prompt takes about 0.1-0.2 s
to tokenize), so its lane has a quarter of the cores, at least one thread: the engine thread and
the event loop keep a core. On 2 cores, 200 KB prompts sent four at a time next to 64 short
greedy streams made their median latency 4-6x what it is alone with two heavy threads, 1.3-2.5x
with one.
The heavy and grammar lanes' threads run at a lower scheduling priority (nice +10, as the
background compile does), so that on a busy machine the engine's steps and the light lane get a
core first.
A small request (a body of at most INLINE_BODY_BYTES, ``mark_body``) does its part inline on
the event loop instead: parsing and tokenizing a few hundred bytes takes tens of microseconds,
while each hop to a thread waits for that thread to be scheduled and to take the GIL, which on
a busy 2-core machine took 1-20 ms a hop (a streamed request makes one per token).
A larger body is parsed, and its constraint's limits checked, in a process (``checker``,
body_check.py): those walks hold the GIL, which the threads here share with the event loop.
A request is marked with ``mark_heavy()``; the mark lives in the handler's task (a ContextVar).
Each thread encodes with its own copy of the tokenizer (a fast tokenizer shared between threads
that encode can fail with "Already borrowed"). Bodies are serialized by orjson, which holds the
GIL for a fraction of what the standard library's encoder did: a response of echoed prompt
logprobs (13,000 floats, 350 KB) took 7.2 ms to encode with ``json.dumps``, which formats each
float through Python, and 0.27 ms with orjson.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import functools
import os
import threading

import orjson

from pagedjax.entrypoints.openai.body_check import BodyChecker
from pagedjax.worker.warmup import lower_priority


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


HEAVY_THREADS = max(1, _cores() // 4)
LANES = {"light": 4, "heavy": HEAVY_THREADS, "grammar": 2}  # threads per lane
LOW_PRIORITY_LANES = ("heavy", "grammar")
HEAVY_BODY_BYTES = 64 * 1024  # a body over this is parsed, tokenized and answered in "heavy"
INLINE_BODY_BYTES = 4 * 1024  # a body up to this is parsed, tokenized and answered inline
_lane: contextvars.ContextVar[str] = contextvars.ContextVar("pagedjax_lane", default="light")


class Offload:
    """Bounded pools of worker threads: ``await offload.run(fn, *args)`` runs fn in the request's
    lane (light, or heavy once marked), ``await offload.run_grammar(fn, *args)`` in grammar."""

    def __init__(self, tokenizer, lanes: dict[str, int] | None = None):
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._pools = {
            lane: concurrent.futures.ThreadPoolExecutor(
                n,
                thread_name_prefix=f"pagedjax-{lane}",
                initializer=lower_priority if lane in LOW_PRIORITY_LANES else None,
            )
            for lane, n in (lanes or LANES).items()
        }
        if threading.current_thread() is threading.main_thread():  # the event loop's, inline
            _ = self.tokenizer  # its copy made now, not by the first small request
        # Bodies over INLINE_BODY_BYTES are parsed and checked in a process (body_check.py)
        self.checker = BodyChecker(HEAVY_THREADS)

    @property
    def tokenizer(self):
        """The calling thread's own copy of the tokenizer (None for a model without one)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self._tokenizer is not None:
            tok = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return tok

    @staticmethod
    def mark_heavy() -> None:
        """From here on, the calling request's work runs in the heavy lane."""
        _lane.set("heavy")

    @staticmethod
    def mark_body(size: int) -> None:
        """The calling request's lane by its body's size: inline, light or heavy."""
        if size > HEAVY_BODY_BYTES:
            _lane.set("heavy")
        elif size <= INLINE_BODY_BYTES:
            _lane.set("inline")

    async def run(self, fn, *args, **kwargs):
        lane = _lane.get()
        if lane == "inline":
            return fn(*args, **kwargs)
        return await self._run(lane, fn, *args, **kwargs)

    async def run_grammar(self, fn, *args, **kwargs):
        return await self._run("grammar", fn, *args, **kwargs)

    async def _run(self, lane: str, fn, *args, **kwargs):
        call = functools.partial(_no_stop_iteration, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pools[lane], call)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self.checker.close()


def _no_stop_iteration(fn, *args, **kwargs):
    """``fn``'s result; a StopIteration it lets out becomes a RuntimeError (as in a generator,
    PEP 479): an asyncio future cannot hold StopIteration, so the request awaiting it would
    never be answered."""
    try:
        return fn(*args, **kwargs)
    except StopIteration as e:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)!s} raised StopIteration") from e


def dumps(value) -> str:
    """JSON as Starlette's JSONResponse writes it (compact, UTF-8; keys that are not strings
    written as strings, as ``json.dumps`` does). A non-finite float, which no response holds
    (logprobs are floored at -9999), is written as null."""
    return dumps_bytes(value).decode()


def dumps_bytes(value) -> bytes:
    """``dumps`` as UTF-8 bytes (a response body)."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
