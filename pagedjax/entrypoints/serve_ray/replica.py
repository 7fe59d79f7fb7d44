"""One Ray Serve replica: one pagedjax engine and its OpenAI app, driven in process (asgi).

The replica's Ray resources (num_cpus / num_gpus) decide its devices: Ray sets
CUDA_VISIBLE_DEVICES for the GPUs it grants, and the engine runs tensor parallel over all the
devices JAX sees when ``tensor_parallel_size`` asks for it (JAX's own runtime, inside the
replica). ``record_routing_stats`` feeds the request router the engine's queue and KV usage.
"""

from __future__ import annotations

import asyncio
import os

from ray import serve

from pagedjax.entrypoints.serve_ray import asgi


def _load(model, served_model_name, llm_kwargs, server_kwargs, startup_kwargs):
    """The replica's engine and app (entrypoints/launch.py, as ``pagedjax serve``'s):
    ``llm_kwargs`` are LLM's keywords (as LLM's, no periodic stats line unless asked for),
    ``server_kwargs`` the app's options (AppOptions), ``startup_kwargs`` what compiles before it
    answers (EngineOptions' warmup, warmup_all, background_compile)."""
    from pagedjax.engine.arg_utils import EngineArgs
    from pagedjax.engine.hosting.startup import EngineOptions
    from pagedjax.entrypoints.launch import launch_server
    from pagedjax.entrypoints.openai.app_options import AppOptions
    from pagedjax.utils.log_setup import configure_default_logging

    configure_default_logging()
    engine_args = EngineArgs.from_keywords(model, **{"disable_log_stats": True, **llm_kwargs})
    app_options = AppOptions(**server_kwargs)
    options = EngineOptions(engine_args, app_options.limits.max_queue, **startup_kwargs)
    client, app = launch_server(options, served_model_name, app_options)
    return client, app


@serve.deployment(name="PagedJaxEngine")
class EngineReplica:
    async def __init__(
        self,
        model: str,
        served_model_name: str | list[str],
        llm_kwargs: dict | None = None,
        server_kwargs: dict | None = None,
        startup_kwargs: dict | None = None,
    ):
        self._client, self._app = await asyncio.to_thread(
            _load,
            model,
            served_model_name,
            llm_kwargs or {},
            server_kwargs or {},
            startup_kwargs or {},
        )
        self._lifespan = asgi.Lifespan(self._app)
        await self._lifespan.start()  # starts the engine thread

    async def handle(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        prefix: list[str] | None = None,  # read by the request router
        routing: str = "prefix",  # read by the request router
    ):
        """One HTTP request through the app: see asgi.call for the items streamed back."""
        scope = asgi.http_scope(method, path, query, headers)
        replica_id = serve.get_replica_context().replica_id.unique_id
        async for item in asgi.call(self._app, scope, body):
            if isinstance(item, dict):  # the start: say which replica answers
                item["headers"].append(("x-pagedjax-replica", replica_id))
            yield item

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this for the request router (RunningReplica.routing_stats)."""
        s = self._client.metrics.engine_stats
        if s is None:
            return {}
        return {
            "waiting": s.num_requests_waiting,
            "running": s.num_requests_running,
            "kv_usage": s.num_blocks_used / max(1, s.num_blocks_total),
        }

    def engine_info(self, *, routing: str = "random") -> dict:
        """This replica's process id, Ray Serve id, prefix-cache counts and aborted requests
        (operators, tests).
        ``routing`` is read by the request router: random, so that repeated calls reach every
        replica."""
        metrics = self._client.metrics
        s = metrics.engine_stats
        return {
            "pid": os.getpid(),
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "prefix_cache_queries": s.prefix_cache_queries if s else 0,
            "prefix_cache_hits": s.prefix_cache_hits if s else 0,
            "aborted": metrics.registry.get_sample_value(
                "pagedjax_request_success_total", {"finished_reason": "abort"}
            )
            or 0,
        }

    async def check_health(self) -> None:
        if not self._client.is_running:
            raise RuntimeError("the engine thread has stopped")

    async def __del__(self):
        await self._lifespan.stop()
        self._client.close()
