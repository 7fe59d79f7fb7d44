"""The Ray Serve ingress: every HTTP request goes, unchanged, to an engine replica chosen by the
request router (router.PrefixAwareRouter) from the request's prompt prefix (prefix_key).

The ingress reads each body within the server's limits (the same 413, 408 and 400s as the
plain server: request_body.py) before it routes it; the replica's app answers everything else
as the plain server does, any method (CORS preflights and HEAD included). A body whose prompt
cannot be read for routing (not JSON, nested too deep) routes without a prefix, and the app
answers it.

A replica that dies before it answered is retried on another (``retries`` times, then 503 with
OpenAI's error JSON); one that dies mid-stream ends that stream with an error event (SSE) or a
cut connection; other requests are not touched. Ray Serve restarts the replica.
"""

import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from pagedjax.entrypoints.openai.protocol import APIError, ServerLimits
from pagedjax.entrypoints.openai.request_body import read_body_within
from pagedjax.entrypoints.serve_ray.prefix_key import block_hashes, prompt_text

logger = logging.getLogger("pagedjax.entrypoints.serve_ray")

REPLICA_LOST = (RayActorError, ActorUnavailableError)
_HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]  # all go to the app

# No `from __future__ import annotations` here: FastAPI reads the handler's annotations through
# serve.ingress. Everything the handler uses is defined above the class: the decorators capture
# the module's globals as they stand.
ingress_app = FastAPI(title="pagedjax on Ray Serve", docs_url=None, redoc_url=None)


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "code": "replica_failed"}}


async def _rest(first: bytes, gen, sse: bool):
    """The body: the first chunk, then the replica's; a lost replica ends an event stream with
    an error event (no [DONE]) and cuts any other body (the client sees a broken response)."""
    done = False
    try:
        yield first
        async for chunk in gen:
            yield chunk
        done = True
    except REPLICA_LOST as e:
        done = True
        if not sse:
            raise
        msg = f"the engine replica failed mid-stream: {type(e).__name__}"
        yield f"data: {json.dumps(_error(msg))}\n\n".encode()
    finally:
        if not done:  # the client left: cancelling the call aborts the request on the replica
            gen.cancel()


@serve.deployment(
    name="PagedJaxIngress", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}
)
@serve.ingress(ingress_app)
class Ingress:
    def __init__(
        self,
        engine: DeploymentHandle,
        routing: str = "prefix",
        retries: int = 1,
        limits: ServerLimits | None = None,
    ):
        self._engine = engine.options(stream=True)
        self._routing = routing
        self._retries = retries
        self._limits = limits or ServerLimits()  # the replicas' own (build_app's limits)

    @ingress_app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, path: str, request: Request):
        try:
            body = await read_body_within(request, self._limits)
        except APIError as e:
            return e.response()
        prefix = block_hashes(prompt_text(body)) if request.method == "POST" else []
        headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_BY_HOP]
        call = (request.method, "/" + path, request.url.query.encode(), headers, body)
        for attempt in range(self._retries + 1):
            gen = self._engine.handle.remote(*call, prefix=prefix, routing=self._routing)
            try:
                first = await gen.__anext__()
                break
            except REPLICA_LOST as e:
                logger.warning("replica lost before answering /%s (try %d): %s", path, attempt, e)
                lost = e
        else:
            msg = f"the engine replica failed before answering: {type(lost).__name__}"
            return JSONResponse(_error(msg), status_code=503)
        sse = any(k.lower() == "content-type" and "event-stream" in v for k, v in first["headers"])
        return StreamingResponse(
            _rest(first["body"], gen, sse),
            status_code=first["status"],
            headers={k: v for k, v in first["headers"] if k.lower() != "content-length"},
        )
