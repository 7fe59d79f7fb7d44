"""Each HTTP request's outputs on their way from the engine thread to its handler (vLLM's
RequestOutputCollector): the latest unread output of each of its engine requests, and one
wake-up of the event loop for all the handlers whose outputs arrived meanwhile."""

from __future__ import annotations

import asyncio
import threading

from pagedjax.outputs import RequestOutput


class Wakeups:
    """Wakes, from the engine thread, the handlers whose requests got outputs: one call into the
    event loop for all the handlers woken while it was on its way (each ``call_soon_threadsafe``
    writes to the loop's self-pipe and runs a callback of its own)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._jobs: list[Job] = []
        self._scheduled = False

    def add(self, job: Job) -> None:  # on the engine thread
        with self._lock:
            self._jobs.append(job)
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:  # on the event loop
        with self._lock:
            jobs, self._jobs, self._scheduled = self._jobs, [], False
        for job in jobs:
            job.wake()


class Job:
    """One HTTP request's engine requests (one per prompt) and what their outputs left for its
    handler. Outputs are cumulative, so a handler that falls behind its engine reads each
    request's latest output alone (vLLM's RequestOutputCollector): one event for the tokens of
    several steps, one wake-up of the event loop for all that arrived while it was busy."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        coalesce: bool = True,
        wakeups: Wakeups | None = None,
    ):
        self.loop = loop
        self.coalesce = coalesce  # False: every output is kept (outputs that are not cumulative)
        self.wakeups = wakeups if wakeups is not None else Wakeups(loop)
        self.request_ids: list[str] = []
        self.finished: set[str] = set()
        self._lock = threading.Lock()
        self._items: list = []  # outputs and exceptions, in arrival order
        self._slot: dict[str, int] = {}  # a request's output still unread: its place in _items
        self._waiter: asyncio.Future | None = None  # the handler waiting, if it is
        self._woken = False  # a wake-up is on its way to the event loop
        self._held: list = []  # taken by the handler, handed out at its next call

    def sink(self, item) -> None:  # called on the engine thread
        with self._lock:
            slot = self._slot.get(item.request_id) if isinstance(item, RequestOutput) else None
            if slot is not None:
                self._items[slot] = item  # it supersedes the unread one
            else:
                if isinstance(item, RequestOutput) and self.coalesce:
                    self._slot[item.request_id] = len(self._items)
                self._items.append(item)
            if self._woken:
                return
            self._woken = True
        self.wakeups.add(self)

    def wake(self) -> None:  # on the event loop
        if self._waiter is not None:
            release(self._waiter)

    async def wait(self, timeout: float) -> list:
        """What arrived since the last call (waiting up to ``timeout`` seconds for something);
        [] if nothing did."""
        if self._held:
            items, self._held = self._held, []
            return items
        with self._lock:
            pending = bool(self._items)
        if not pending:
            self._waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout, release, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        with self._lock:
            items, self._items, self._slot = self._items, [], {}
            self._woken = False
        return items

    def hold(self, items: list) -> None:
        """Give back ``items`` (taken by ``wait``) for its next call."""
        self._held = items + self._held

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)


def release(waiter: asyncio.Future) -> None:
    """End a handler's wait (its outputs arrived, or its timer ran out), once."""
    if not waiter.done():
        waiter.set_result(None)
