"""The stages, in the order they run. A stage is a module here with
``run(ctx, budget, data) -> (ok, summary)`` and one line below: key -> (number, title, run)."""

from __future__ import annotations

from . import backends, decode, engine_8b, engine_tiny, env, kernels, peer, probe, serve

STAGES = {
    "env": ("1", "environment", env.run),
    "kernels": ("2", "kernel correctness vs float32 reference", kernels.run),
    "engine_tiny": (
        "3a",
        "engine: tiny Llama vs transformers, preemption, prefix caching",
        engine_tiny.run,
    ),
    "engine_8b": ("3b", "engine: Llama-3-8B-shaped bfloat16 throughput", engine_8b.run),
    "decode": ("4", "decode-kernel benchmark", decode.run),
    "peer": ("5", "transformers on the same device", peer.run),
    "serve": ("6", "online serving: pagedjax serve vs transformers serve", serve.run),
    "backends": (
        "7",
        "attention backends vs a float64 oracle; decode bandwidth per backend",
        backends.run,
    ),
    "probe": ("8", "probes: scan vs per-layer weights; dispatch vs device time", probe.run),
}
