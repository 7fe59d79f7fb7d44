"""What the machine can do and what a workload needs: matmul FLOP/s measured at the model's own
shapes, and the useful FLOPs of a generation workload (padding and recomputation excluded).

A throughput figure divided by the roofline says how much of the machine an engine uses, which
compares engines better than their ratio alone: a ratio against a slow peer can flatter.
"""

from __future__ import annotations

import time

import numpy as np


def linear_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of each matmul of one decoder layer, as the model runs them."""
    h, hd = config.hidden_size, config.head_dim
    return [
        (h, config.num_heads * hd),  # q
        (h, 2 * config.num_kv_heads * hd),  # k, v
        (config.num_heads * hd, h),  # o
        (h, 2 * config.intermediate_size),  # gate, up
        (config.intermediate_size, h),  # down
    ]


def flops_per_token(config) -> tuple[int, int]:
    """(FLOPs of the layers' matmuls for one token, FLOPs of the LM head for one logit row)."""
    layer = sum(2 * a * b for a, b in linear_shapes(config))
    return layer * config.num_layers, 2 * config.hidden_size * config.vocab_size


def attention_flops(config, context_len: int) -> int:
    """FLOPs of one token's attention (scores and values) over ``context_len`` keys."""
    return 4 * config.num_heads * config.head_dim * context_len * config.num_layers


def workload_flops(config, requests) -> float:
    """Useful FLOPs of generating ``requests`` (prompt_token_ids, output_len): every prompt and
    output token through the layers once, attention over its real context, one LM-head row per
    generated token. What an engine spends beyond this (padding, recomputation) is its own."""
    layers, head = flops_per_token(config)
    total = 0.0
    for r in requests:
        p, o = len(r.prompt_token_ids), r.output_len
        n = p + o - 1  # the last generated token is never fed back
        total += layers * n + head * o
        # token at position t attends t + 1 keys: sum over t < n of (t + 1) = n (n + 1) / 2
        total += attention_flops(config, 1) * n * (n + 1) / 2
    return total


def _best_rate(run, flops: float, seconds: float) -> float:
    run()  # warm (compiles, allocates)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            return flops / best


def matmul_flops(config, num_tokens: int = 256, seconds: float = 1.0) -> dict[str, float]:
    """Peak FLOP/s this machine reaches on one layer's matmuls at ``num_tokens`` rows (float32),
    through XLA (jax) and, if installed, PyTorch; the best of repeated runs of each."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    shapes = linear_shapes(config)
    xs = [rng.standard_normal((num_tokens, a), np.float32) for a, _ in shapes]
    ws = [rng.standard_normal((a, b), np.float32) * 0.02 for a, b in shapes]
    flops = float(sum(2 * num_tokens * a * b for a, b in shapes))

    jx = [jnp.asarray(x) for x in xs]
    jw = [jnp.asarray(w) for w in ws]
    step = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)])
    out = {"jax": _best_rate(lambda: jax.block_until_ready(step(jx, jw)), flops, seconds)}
    try:
        import torch
    except ImportError:
        return out
    tx = [torch.from_numpy(x) for x in xs]
    tw = [torch.from_numpy(w) for w in ws]

    def torch_run():
        with torch.inference_mode():
            for x, w in zip(tx, tw, strict=True):
                x @ w

    out["torch"] = _best_rate(torch_run, flops, seconds)
    return out
