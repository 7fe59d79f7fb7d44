"""Drive an ASGI app in process: its lifespan, and one HTTP request as a stream of items.

A replica serves the unchanged pagedjax FastAPI app this way, so every route, check and
streaming format stays the app's own. The stream's first item is ``{"status", "headers",
"body"}`` (the response start with its first body chunk, so that nothing reaches the client
before the replica has answered), the rest are body chunks (bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

_END = object()


class Lifespan:
    """Runs the app's lifespan: ``start`` waits for its start-up, ``stop`` for its shutdown."""

    def __init__(self, app):
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._task = asyncio.create_task(self.app(scope, self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup.complete")

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._expect("lifespan.shutdown.complete")
        await self._task

    async def _expect(self, kind: str) -> None:
        msg = await self._outbox.get()
        if msg["type"] != kind:
            raise RuntimeError(f"the app's lifespan failed: {msg.get('message', msg['type'])}")


def http_scope(method: str, path: str, query: bytes, headers: list[tuple[str, str]]) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
        "state": {},
    }


async def call(app, scope: dict, body: bytes) -> AsyncIterator[dict | bytes]:
    """One request through ``app``. Closing the iterator early (the client left) tells the app
    that the client disconnected, which aborts the request in the engine."""
    out: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run():
        try:
            await app(scope, receive, out.put)
        finally:
            await out.put(_END)

    task = asyncio.create_task(run())
    try:
        start, answered = None, False
        while (msg := await out.get()) is not _END:
            if msg["type"] == "http.response.start":
                start = msg
            elif msg["type"] == "http.response.body" and not answered:
                answered = True
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start["headers"]]
                yield {"status": start["status"], "headers": headers, "body": msg.get("body", b"")}
            elif msg["type"] == "http.response.body" and msg.get("body"):
                yield msg["body"]
        await task  # re-raises what the app raised
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
