"""What a user chooses for a Ray Serve deployment of pagedjax; validated, and turned into Ray
Serve's deployment options. Imports no ray."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedjax.engine.arg_utils import EngineArgs

ROUTING_POLICIES = ("prefix", "random")


@dataclass(frozen=True)
class AutoscalingOptions:
    """Ray Serve's autoscaling on ongoing requests per replica (queued + running)."""

    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    look_back_period_s: float = 10.0  # ongoing requests are averaged over this window
    metrics_interval_s: float = 1.0  # how often replicas report them

    def __post_init__(self):
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"max_replicas must be >= max(1, min_replicas), got {self.max_replicas}"
            )
        if self.target_ongoing_requests <= 0:
            raise ValueError(
                f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}"
            )
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("look_back_period_s", "metrics_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def to_ray(self) -> dict:
        return {
            "min_replicas": self.min_replicas,
            "initial_replicas": max(1, self.min_replicas),
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
        }


@dataclass(frozen=True)
class RayServeOptions:
    """Replicas, their Ray resources, the routing policy and (optionally) autoscaling.

    ``num_gpus`` may exceed 1: the replica's engine then runs tensor parallel over the devices
    Ray gives it (JAX's own runtime inside the replica). ``max_ongoing_requests`` bounds the
    requests Ray hands one replica at a time (its engine queues them).
    """

    num_replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    routing: str = "prefix"
    max_ongoing_requests: int = 256
    autoscaling: AutoscalingOptions | None = None
    routing_stats_period_s: float = 1.0
    ray_actor_options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(
                f"num_cpus and num_gpus must be >= 0, got {self.num_cpus}, {self.num_gpus}"
            )
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.routing_stats_period_s <= 0:
            raise ValueError(
                f"routing_stats_period_s must be > 0, got {self.routing_stats_period_s}"
            )

    def replica_deployment_options(self) -> dict:
        """Keyword arguments for ``EngineReplica.options(...)``."""
        actor = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **self.ray_actor_options}
        opts = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
            "request_router_config": {
                "request_router_class": "pagedjax.entrypoints.serve_ray.router:PrefixAwareRouter",
                "request_routing_stats_period_s": self.routing_stats_period_s,
                "request_routing_stats_timeout_s": max(5.0, 5 * self.routing_stats_period_s),
            },
        }
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.to_ray()
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


_NUMBERS = {
    "num_replicas": int,
    "num_cpus": float,
    "num_gpus": float,
    "max_ongoing_requests": int,
    "routing_stats_period_s": float,
}


def builder_arguments(args: dict) -> tuple[str, RayServeOptions, dict]:
    """(model, options, build's keyword arguments) from ``serve run`` arguments: ``model``,
    ``served_model_name``, the RayServeOptions fields (numbers may come as strings;
    ``autoscaling`` a dict of AutoscalingOptions fields) and ``llm_kwargs`` / ``server_kwargs``
    / ``startup_kwargs`` (dicts, or JSON strings on the command line)."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("model is required (model=PATH)")
    model = args.pop("model")
    kwargs = {
        k: _dict(args.pop(k, None)) for k in ("llm_kwargs", "server_kwargs", "startup_kwargs")
    }
    try:  # each replica's LLM keywords are EngineArgs': checked here, before anything deploys
        EngineArgs.from_keywords(model, **kwargs["llm_kwargs"])
    except TypeError as e:
        raise ValueError(f"llm_kwargs: {e}") from None
    kwargs["served_model_name"] = args.pop("served_model_name", None)
    scale = _dict(args.pop("autoscaling", None))
    for key, kind in _NUMBERS.items():
        if key in args:
            args[key] = kind(args[key])
    options = RayServeOptions(**args, autoscaling=AutoscalingOptions(**scale) if scale else None)
    return model, options, kwargs


def _dict(value) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)
