"""A request's body read within the server's limits (``ServerLimits``): over
``max_body_bytes`` a 413 (the declared length refused before reading), not all there within
``body_timeout_s`` a 408, a client gone before the end a 400. The plain server's handlers read
their bodies so (app_state.read_body), and so does the Ray Serve ingress before it routes one
(entrypoints/serve_ray/ingress.py): both answer a body the same way.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from pagedjax.entrypoints.openai.protocol import APIError, ServerLimits, bad_request


async def read_body_within(request: Request, limits: ServerLimits) -> bytes:
    """The body's bytes, or an APIError (413, 408 or 400) naming the limit it broke."""
    too_big = APIError(
        413, f"request body over {limits.max_body_bytes} bytes", "invalid_request_error"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
        raise too_big
    body = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout_s
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(chunks), deadline - loop.time())
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {limits.body_timeout_s} s",
                "invalid_request_error",
                "request_timeout",
            ) from None
        except ClientDisconnect:
            raise bad_request("the client left before sending the whole body") from None
        body += chunk
        if len(body) > limits.max_body_bytes:
            raise too_big
    return bytes(body)
