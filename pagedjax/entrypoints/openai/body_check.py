"""Large request bodies parsed and checked in a process of their own.

Parsing a body and checking a structured-output constraint's limits are pure Python walks over
every value of the body: a 90 KB schema of 1,500 ``$ref`` hops costs 5-11 ms, holding the GIL
all along. On the offload threads (offload.py) that GIL is the event loop's too, so while bodies
like it arrive four at a time, every stream's next token waits for it, whatever the thread's
scheduling priority: on 2 cores, a flood of such bodies (all refused) made 64 short greedy
streams take 1.9-2.2x their time alone. Here a body of more than ``INLINE_BODY_BYTES`` is parsed
into its request model and its constraint checked in a worker process (niced, as the background
compile is), which answers the request model and its constraint, or the error to send (the same
400 the threads would have sent): the event loop only unpickles what comes back.

The workers start on first use (``start()`` starts them ahead, as ``pagedjax serve`` does: a
worker imports the protocol models, about 1.5 s). A worker that dies (killed, out of memory)
fails the bodies it held with a 500 naming it; the next body starts a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import types
from concurrent.futures.process import BrokenProcessPool

logger = logging.getLogger("pagedjax.api_server")

PRIORITY = 10  # the workers' nice value: the engine and the event loop get a core first
_MAIN_SWAP = threading.Lock()


def _init_worker() -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, PRIORITY)
    _die_with_parent()
    from pagedjax.entrypoints.openai import protocol  # noqa: F401  (imported once, here)


def _die_with_parent() -> None:
    """Linux: a worker is sent SIGTERM when the thread that started it ends (the event loop's,
    or serve's main thread: both live as long as the server), however it ends; a pool's worker
    holds its own end of the task pipe, so it would wait on it forever."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the server ended before the call: end now
            os._exit(0)


_PR_SET_PDEATHSIG = 1


def _ready() -> int:
    return os.getpid()


def check_body(model_cls, body: bytes):
    """In a worker: (the request or None, (constraint, its field) or None, the arguments of the
    APIError to raise or None). A body that does not parse has no request; a request whose
    constraint is refused has the error and no constraint (the server names an unknown model
    first, as it does for a small body)."""
    from pagedjax.entrypoints.openai.protocol import APIError, parse_json, parse_request
    from pagedjax.entrypoints.openai.request_params import structured_outputs

    req = None
    try:
        req = parse_request(model_cls, parse_json(body))
        return req, structured_outputs(req), None
    except APIError as e:
        return req, None, (e.status, e.message, e.type, e.code, e.param)
    except StopIteration as e:  # a future awaited by asyncio cannot hold it: offload.py
        raise RuntimeError("checking the body raised StopIteration") from e


class BodyChecker:
    """A pool of ``workers`` processes running ``check_body``."""

    def __init__(self, workers: int = 1):
        self.workers = workers
        self.num_checked = 0  # bodies a worker answered (refused or not)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self) -> concurrent.futures.Future:
        """Start the workers (if not running): a future done once one is ready."""
        return self._submit(self._executor(), _ready)

    @staticmethod
    def _submit(pool, fn, *args) -> concurrent.futures.Future:
        """``pool.submit``, which starts a worker when one is missing, with the caller's
        ``__main__`` out of sight: a spawned process runs the main script of its parent again
        (as ``__mp_main__``), and a script or notebook that serves without an
        ``if __name__ == "__main__"`` guard would start another server in the worker."""
        main = sys.modules["__main__"]
        with _MAIN_SWAP:
            sys.modules["__main__"] = types.ModuleType("__main__")
            try:
                return pool.submit(fn, *args)
            finally:
                sys.modules["__main__"] = main

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                )
            return self._pool

    async def check(self, model_cls, body: bytes, resolve=lambda req: None):
        """(request, constraint, its field) of ``body`` parsed as ``model_cls``, ``resolve(req)``
        called before a refused constraint is raised (the served model's name is checked first,
        as for a small body); a refused body raises the APIError the threads would have raised."""
        from pagedjax.entrypoints.openai.protocol import APIError

        for _ in range(2):  # a pool found broken before this body was sent: a new one
            pool = self._executor()
            try:
                fut = self._submit(pool, check_body, model_cls, body)
            except BrokenProcessPool:
                self._drop(pool)
                continue
            break
        try:
            req, constraint, err = await asyncio.wrap_future(fut)
        except BrokenProcessPool as e:  # a worker died while this body was in it
            self._drop(pool)
            logger.error("the body-check process died: %s", e)
            raise APIError(
                500, f"the body-check process died: {e}", "server_error", "body_check_failed"
            ) from None
        self.num_checked += 1
        if req is not None:
            resolve(req)
        if err is not None:
            raise APIError(*err)
        return req, *constraint

    def _drop(self, pool) -> None:
        """Forget a broken pool: the next body starts a new worker."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def worker_pids(self) -> list[int]:
        """The running workers' process ids."""
        pool = self._pool
        return [] if pool is None else list(getattr(pool, "_processes", None) or {})

    def close(self) -> None:
        """Stop the workers (a body in check finishes first: its walk is bounded by its size)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
