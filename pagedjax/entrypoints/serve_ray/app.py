"""Assemble and run the Ray Serve application: ingress -> engine replicas.

``build`` for Python, ``app_builder`` for ``serve run`` (a config file or ``key=value``
arguments), ``run`` for ``pagedjax serve --ray``.
"""

from __future__ import annotations

import time

from ray import serve

from pagedjax.entrypoints.serve_ray.ingress import Ingress
from pagedjax.entrypoints.serve_ray.options import RayServeOptions, builder_arguments
from pagedjax.entrypoints.serve_ray.replica import EngineReplica


def build(
    model: str,
    options: RayServeOptions | None = None,
    *,
    served_model_name: str | list[str] | None = None,
    llm_kwargs: dict | None = None,
    server_kwargs: dict | None = None,
    startup_kwargs: dict | None = None,
):
    """The application: ``llm_kwargs`` are each replica's engine arguments (LLM's keywords),
    ``server_kwargs`` its app's options (AppOptions: api_key, limits, ...), ``startup_kwargs``
    what compiles before it answers (EngineOptions: warmup, warmup_all, background_compile)."""
    options = options or RayServeOptions()
    names = served_model_name or model
    engine = EngineReplica.options(**options.replica_deployment_options()).bind(
        model, names, llm_kwargs, server_kwargs, startup_kwargs
    )
    limits = (server_kwargs or {}).get("limits")  # the ingress reads bodies within them too
    return Ingress.bind(engine, routing=options.routing, limits=limits)


def app_builder(args: dict):
    """For ``serve run pagedjax.entrypoints.serve_ray.app:app_builder model=PATH num_replicas=2
    ...`` or a Serve config file's ``import_path`` (arguments: options.builder_arguments)."""
    model, options, kwargs = builder_arguments(args)
    return build(model, options, **kwargs)


def run(
    model: str,
    options: RayServeOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    **build_kwargs,
) -> None:
    """Join (``address``) or start a Ray cluster, deploy, and serve until interrupted."""
    import ray

    ray.init(address=address)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(model, options, **build_kwargs), name="pagedjax", route_prefix="/")
    print(f"pagedjax on Ray Serve at http://{host}:{port} (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
