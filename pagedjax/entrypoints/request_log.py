"""vLLM's ``--enable-log-requests``: one INFO line per request the server receives (its method,
path and body, the body cut at ``--max-log-len`` characters), written when the body has arrived.
An ASGI wrapper: it reads what the app reads and changes nothing of it."""

from __future__ import annotations

import logging

logger = logging.getLogger("pagedjax.api_server.requests")
DEFAULT_MAX_LOG_LEN = 2048  # characters of a body kept in its line when no limit is given


class RequestLog:
    def __init__(self, app, max_log_len: int | None = None):
        self.app = app
        self.max_log_len = DEFAULT_MAX_LOG_LEN if max_log_len is None else max_log_len

    def __getattr__(self, name):  # app.state and the like stay reachable
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] in ("GET", "HEAD"):  # no body to wait for
            logger.info("Received request %s %s", scope["method"], scope["path"])
            return await self.app(scope, receive, send)
        kept = bytearray()  # at most max_log_len bytes of the body, however large it is
        logged = False

        async def logging_receive():
            nonlocal logged
            message = await receive()
            if message["type"] == "http.request" and not logged:
                room = self.max_log_len - len(kept)
                if room > 0:
                    kept.extend(message.get("body", b"")[:room])
                if not message.get("more_body", False):
                    logged = True
                    body = kept.decode("utf-8", "replace")
                    logger.info("Received request %s %s: %s", scope["method"], scope["path"], body)
            return message

        return await self.app(scope, logging_receive, send)
