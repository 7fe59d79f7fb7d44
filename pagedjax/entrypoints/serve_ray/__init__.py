"""Scale-out on Ray Serve: replicas of the pagedjax engine behind one OpenAI-compatible ingress.

Each replica (``replica.EngineReplica``) holds one engine and serves the unchanged FastAPI app of
``pagedjax.entrypoints.openai`` in process; the ingress (``ingress.Ingress``) reads a request,
keys it by its prompt's first blocks (``prefix_key``) and forwards it through a Ray Serve handle
whose request router (``router.PrefixAwareRouter``) picks the replica: the one that served the
prefix before, else the least loaded. ``app.build`` assembles the application; ``options``
holds the user's choices (replicas, resources, routing, autoscaling) without importing ray.

Needs the ``ray`` extra: ``pip install 'pagedjax[ray]'``.
"""

from pagedjax.entrypoints.serve_ray.options import AutoscalingOptions, RayServeOptions

__all__ = ["AutoscalingOptions", "RayServeOptions"]
