"""Work that must not hold the event loop: tokenizing prompts, rendering chat templates,
compiling grammars and building large responses run on a fixed number of threads, so that
/health and every other connection keep being served while one request's heavy part runs.

Each thread encodes with its own copy of the tokenizer (a fast tokenizer shared between threads
that encode can fail with "Already borrowed"). Bodies are serialized a slice at a time, so that
one huge body never holds the GIL in a single call of the JSON encoder.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import json
import threading

OFFLOAD_THREADS = 4
_JSON_SLICE = 1024  # list items encoded per call of the C encoder


class Offload:
    """A bounded pool of worker threads; ``await offload.run(fn, *args)`` runs fn on one."""

    def __init__(self, tokenizer, threads: int = OFFLOAD_THREADS):
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="pagedjax-offload"
        )

    @property
    def tokenizer(self):
        """The calling thread's own copy of the tokenizer (None for a model without one)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self._tokenizer is not None:
            tok = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return tok

    async def run(self, fn, *args, **kwargs):
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def dumps(value) -> str:
    """``json.dumps`` as Starlette's JSONResponse writes it (compact, UTF-8, finite numbers),
    long lists encoded ``_JSON_SLICE`` items at a time."""
    if isinstance(value, dict):
        items = (_encode(str(k)) + ":" + dumps(v) for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, list) and len(value) > _JSON_SLICE:
        slices = range(0, len(value), _JSON_SLICE)
        return "[" + ",".join(_encode(value[i : i + _JSON_SLICE])[1:-1] for i in slices) + "]"
    return _encode(value)


def _encode(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
