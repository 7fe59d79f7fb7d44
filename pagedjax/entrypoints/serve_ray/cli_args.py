"""``pagedjax serve --ray``: the flags, and the start from parsed arguments. Imports ray only
when the server starts."""

from __future__ import annotations

import argparse

from pagedjax.entrypoints.serve_ray.options import (
    ROUTING_POLICIES,
    AutoscalingOptions,
    RayServeOptions,
)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (scale-out: replicas of the engine; needs pagedjax[ray])")
    g.add_argument("--ray", action="store_true", help="serve replicas of the engine on Ray Serve")
    g.add_argument("--ray-address", default=None, help="Ray cluster to join (default: local)")
    g.add_argument("--num-replicas", type=int, default=1, help="engine replicas")
    g.add_argument("--replica-num-cpus", type=float, default=1.0, help="CPUs per replica")
    g.add_argument(
        "--replica-num-gpus",
        type=float,
        default=0.0,
        help="GPUs per replica (more than one: the replica runs tensor parallel over them)",
    )
    g.add_argument(
        "--routing",
        default="prefix",
        choices=ROUTING_POLICIES,
        help="which replica takes a request: the one holding its prompt's prefix, or any "
        "(default: prefix)",
    )
    g.add_argument(
        "--autoscale-max-replicas",
        type=int,
        default=None,
        help="autoscale between --num-replicas and this on ongoing requests per replica",
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=4.0,
        help="autoscaling's target of requests per replica, queued and running (default: 4)",
    )


def ray_options(args: argparse.Namespace) -> RayServeOptions:
    scale = None
    if args.autoscale_max_replicas is not None:
        scale = AutoscalingOptions(
            min_replicas=args.num_replicas,
            max_replicas=args.autoscale_max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
        )
    return RayServeOptions(
        num_replicas=args.num_replicas,
        num_cpus=args.replica_num_cpus,
        num_gpus=args.replica_num_gpus,
        routing=args.routing,
        max_ongoing_requests=max(1, args.max_queue),
        autoscaling=scale,
    )


def serve_on_ray(args: argparse.Namespace, llm_kwargs: dict, server_kwargs: dict) -> int:
    """Validate (ValueError before anything starts), then deploy and serve until interrupted."""
    options = ray_options(args)
    if args.num_processes:
        raise ValueError("--ray replicas are single-process; drop --num-processes")
    from pathlib import Path

    from pagedjax.entrypoints.serve_ray.app import run
    from pagedjax.models.loader import default_model_path

    model = args.model or default_model_path()
    run(
        model,
        options,
        host=args.host,
        port=args.port,
        address=args.ray_address,
        served_model_name=args.served_model_name or args.model or Path(model).stem,
        llm_kwargs=llm_kwargs,
        server_kwargs=server_kwargs,
        startup_kwargs={
            "warmup": args.warmup,
            "warmup_all": args.warmup_all,
            "background_compile": args.background_compile,
        },
    )
    return 0
