"""Stage 3b: a Llama-3-8B-shaped random-weight model in bfloat16, built on the device, through
``LLM.generate`` on a ShareGPT-like workload: throughput warm and cold, compiles, memory."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..common import (
    TOY_NOTE,
    Budget,
    Context,
    big_hf_config,
    big_workload,
    fmt_f,
    say,
    shape_name,
)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def random_params(config, dtype: str, seed: int = 0):
    """Random weights on the default device with the model's parameter tree (no host copy):
    norms 1, biases 0, matrices N(0, 0.02)."""
    from pagedjax.models.llama import param_shapes

    shapes = param_shapes(config, dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(flat))

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def init(key, shape, dtype, kind):
        if kind == "norm":
            return jnp.ones(shape, dtype)
        if kind == "bias":
            return jnp.zeros(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, dtype)).astype(dtype)  # no float32 copy

    leaves = []
    for key, (path, s) in zip(keys, flat, strict=True):
        name = jax.tree_util.keystr(path)
        kind = "norm" if "norm" in name else "bias" if "bias" in name else "matrix"
        leaves.append(init(key, s.shape, s.dtype, kind))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def llm_with_weights(loaded, **kwargs):
    """An ``LLM`` over in-memory weights: LLM only takes a path, so its loader (in
    pagedjax/engine/model_loading.py, or LLM's own module in older versions) is replaced by one
    returning ``loaded`` for the duration of the constructor."""
    from pagedjax import LLM

    try:
        import pagedjax.engine.model_loading as module
    except ImportError:  # a version before EngineArgs: LLM loaded the model itself
        module = sys.modules[LLM.__module__]
    if not hasattr(module, "load_model"):
        raise RuntimeError(f"{module.__name__} has no load_model to hand in-memory weights to LLM")
    original = module.load_model
    module.load_model = lambda *a, **k: loaded
    try:
        return LLM(loaded.source, **kwargs)
    finally:
        module.load_model = original


@contextlib.contextmanager
def compile_events():
    """Collect (function name, seconds) of every XLA compilation while the block runs."""
    events: list[tuple[str, float]] = []

    def listen(event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            events.append((str(kw.get("fun_name", "?")), float(duration)))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        with contextlib.suppress(Exception):  # older JAX: no unregister
            jax.monitoring.unregister_event_duration_listener(listen)


def device_memory() -> dict:
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if not stats:
        return {}
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def run(ctx: Context, budget: Budget, data: dict):
    from pagedjax.models.config import ModelConfig

    config = ModelConfig.from_hf_dict(big_hf_config(ctx).to_dict())
    full_layers = ctx.sizes.big_config["num_hidden_layers"]
    data["model"] = (
        f"{shape_name(ctx)} random weights, bfloat16, {config.num_layers} of {full_layers} layers "
        f"(hidden {config.hidden_size}, heads {config.num_heads}/{config.num_kv_heads}, "
        f"vocab {config.vocab_size})"
    )
    say(f"  {data['model']}")
    llm = build_llm(ctx, config, data)
    try:
        cold, timed, stats = cold_and_warm_runs(ctx, llm, config, budget, data)
        budget.check("the profiled run")
        profiled_run(ctx, llm, config, data)
    finally:
        llm.close()
    peak = data["memory"].get("peak_bytes_in_use")
    summary = (
        f"{shape_name(ctx)} ({config.num_layers}/{full_layers} layers) bf16: "
        f"{timed.output_tokens_per_s:.0f} out tok/s warm; cold {cold.elapsed_s:.0f} s with "
        f"{data['cold_compiles']['count']} compiles ({data['cold_compiles']['total_s']:.0f} s, "
        f"max {data['cold_compiles']['max_s']:.1f}); KV blocks {stats.num_blocks_peak}/"
        f"{stats.num_blocks_total}"
        + (f"; process peak {peak / 2**30:.1f} GiB" if peak else "")
        + "".join(
            f"; {kind} {k['device_ms']:.1f} ms/step (host {k['host_ms']:.1f}),"
            f" MBU {fmt_f(k['mbu'])}"
            for kind, k in data["profile"]["per_kind"].items()
        )
    )
    return True, summary + TOY_NOTE * ctx.interpret


def build_llm(ctx: Context, config, data: dict):
    """Random bfloat16 weights built on the device, served by an ``LLM``."""
    from pagedjax.models.loader import LoadedModel

    s = ctx.sizes
    t = time.perf_counter()
    params = random_params(config, "bfloat16")
    jax.block_until_ready(params)
    data["build_params_s"] = time.perf_counter() - t
    data["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(params))
    loaded = LoadedModel(
        config=config, params=params, source="random-llama-3-8b-shaped", tokenizer_dir=None
    )
    return llm_with_weights(
        loaded,
        dtype="bfloat16",
        block_size=16,
        max_model_len=s.max_prompt_len + s.max_output_len,
        max_num_seqs=s.max_num_seqs,
        kv_cache_space_gib=s.kv_cache_space_gib,
        enable_prefix_caching=True,
    )


def cold_and_warm_runs(ctx: Context, llm, config, budget: Budget, data: dict):
    """The workload once cold (other tokens, the same lengths: every program compiles, no prefix
    hits) and once warm (timed); (cold side, warm side, engine stats)."""
    from pagedjax.models.llama import kv_pool_bytes_per_block

    from pagedjax.bench.throughput_sides import Request, generate_pagedjax

    s = ctx.sizes
    requests = big_workload(ctx, config.vocab_size, seed=0)
    rng = np.random.default_rng(99)
    warm = [
        Request(rng.integers(3, config.vocab_size, len(r.prompt_token_ids)).tolist(), r.output_len)
        for r in requests
    ]
    data["workload"] = dict(
        num_requests=len(requests),
        mean_prompt_len=float(np.mean([len(r.prompt_token_ids) for r in requests])),
        mean_output_len=float(np.mean([r.output_len for r in requests])),
        max_prompt_len=s.max_prompt_len,
        max_output_len=s.max_output_len,
        max_num_seqs=s.max_num_seqs,
    )
    say(f"  workload: {data['workload']}")
    with compile_events() as cold_events:
        cold = generate_pagedjax(llm, warm)
    data["cold"] = dataclasses.asdict(cold)
    data["cold_compiles"] = summarize_compiles(cold_events)
    say(f"  cold run (compiles included): {cold.elapsed_s:.1f} s, {data['cold_compiles']}")
    budget.check("the timed (warm) run")
    with compile_events() as warm_events:
        timed = generate_pagedjax(llm, requests)
    data["warm"] = dataclasses.asdict(timed)
    data["warm_compiles"] = summarize_compiles(warm_events)
    stats = llm.get_stats()
    data["stats"] = dataclasses.asdict(stats)
    data["kv_pool_bytes"] = stats.num_blocks_total * kv_pool_bytes_per_block(config, 16, "bfloat16")
    data["memory"] = device_memory()
    say(
        f"  warm run: {timed.elapsed_s:.1f} s, {timed.output_tokens_per_s:.0f} output tok/s, "
        f"{data['warm_compiles']['count']} programs compiled; KV blocks "
        f"{stats.num_blocks_peak}/{stats.num_blocks_total} peak; memory {data['memory']}"
    )
    return cold, timed, stats


def profiled_run(ctx: Context, llm, config, data: dict) -> None:
    """The workload's lengths once more, other tokens, with the step profile's timing on (each
    step waits for the device: no overlap, so not a throughput figure): per step kind ms on the
    host and the device and MBU (bytes a step reads / device time / copy bandwidth)."""
    from pagedjax.bench.throughput_sides import Request, generate_pagedjax

    rng = np.random.default_rng(7)
    requests = [
        Request(rng.integers(3, config.vocab_size, len(r.prompt_token_ids)).tolist(), r.output_len)
        for r in big_workload(ctx, config.vocab_size, seed=0)
    ]
    prof = llm.engine.profile
    prof.reset()
    prof.enabled = True
    try:
        run = generate_pagedjax(llm, requests)
    finally:
        prof.enabled = False
    data["profile"] = {"elapsed_s": run.elapsed_s, **prof.report()}
    say(f"  profiled run ({run.elapsed_s:.1f} s; copy {prof.copy_bytes_per_s / 1e9:.1f} GB/s):")
    say(f"  {'step kind':10s} {'steps':>6s} {'host ms':>8s} {'device ms':>10s} {'GB/step':>8s} MBU")
    for kind, k in data["profile"]["per_kind"].items():
        say(
            f"  {kind:10s} {k['steps']:6d} {k['host_ms']:8.2f} {k['device_ms']:10.2f}"
            f" {k['bytes_per_step'] / 1e9:8.3f} {fmt_f(k['mbu'])}"
        )


def summarize_compiles(events: list[tuple[str, float]]) -> dict:
    secs = [d for _, d in events]
    return {
        "count": len(secs),
        "total_s": float(sum(secs)),
        "max_s": float(max(secs, default=0.0)),
        "per_program_s": [(name, round(d, 3)) for name, d in events],
    }
