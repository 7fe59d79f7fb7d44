"""Stage 8: two probes of the decode step through the project's own Runner, on a random Llama-3-8B-
shaped bfloat16 model of a few layers (toy: the toy Llama).

(a) Layer loop: the same weights run under ``lax.scan`` over stacked layers and unrolled over one
    array per layer (``PAGEDJAX_LAYER_LOOP``, models/layer_loop.py), M = 1 and 64 sequences of one
    context: each step's time as a fraction of its memory floor, the bytes it must read (weights
    once + whole KV pages up to each context: inspection/step_profile.py) over a device copy's
    bandwidth measured in the same run. A loop that copies each layer's weights shows far below 1.
(b) Dispatch vs device time: for the step program with each sampler variant (greedy, sampling,
    sampling with penalties, top logprobs), the host time until the jitted call returns against
    the time until its output is ready. Dispatch that returns well before the device finishes is
    a step with no host wait; a control (a matmul with a ``lax.cond`` on its result) shows the
    method sees a wait where one exists.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import jax
import jax.numpy as jnp

from ..common import TOY_NOTE, Budget, Context, say
from ..sizes import LLAMA3_8B
from .engine_8b import random_params

BLOCK = 16
REPEATS = 5
HOST_WAIT = 0.9  # dispatch returning after this share of the ready time: the host waited


def probe_sizes(ctx: Context) -> dict:
    if ctx.sizes.big_config is LLAMA3_8B:
        return dict(layers=8, rows=(1, 64), context=512, control_n=8192, copy_bytes=1 << 30)
    return dict(layers=2, rows=(1, 8), context=24, control_n=256, copy_bytes=16 << 20)


def run(ctx: Context, budget: Budget, data: dict):
    import transformers
    from pagedjax.models.config import ModelConfig

    from pagedjax.inspection.step_profile import measure_copy_bandwidth

    p = probe_sizes(ctx)
    hf = transformers.LlamaConfig(**dict(ctx.sizes.big_config, num_hidden_layers=p["layers"]))
    config = ModelConfig.from_hf_dict(hf.to_dict())
    copy = measure_copy_bandwidth(p["copy_bytes"])
    data.update(layers=p["layers"], context=p["context"], dtype="bfloat16", copy_gbps=copy / 1e9)
    say(f"  {p['layers']} layers, context {p['context']}, copy {copy / 1e9:.1f} GB/s")
    params = random_params(config, "bfloat16")
    data["layer_loop"], data["dispatch"] = [], []
    for loop in ("unrolled", "scan"):  # unrolled first: the dispatch probe runs on it
        budget.check(f"the {loop} layer loop")
        runner = build_runner(config, params, loop, p)
        try:
            for m in p["rows"]:
                row = loop_row(runner, config, loop, m, p["context"], copy)
                data["layer_loop"].append(row)
                say(
                    f"  {loop:8s} M={m:3d}: {row['step_ms']:.3f} ms, floor {row['floor_ms']:.3f}"
                    f" ms: {row['of_floor']:.2f} of the memory floor"
                )
            if loop == "unrolled":
                budget.check("dispatch vs device time")
                data["dispatch"] = dispatch_rows(runner, config, max(p["rows"]), p["context"])
        finally:
            runner.kv_cache.free()
    data["control"] = cond_control(p["control_n"])
    print_dispatch(data)
    return verdict(ctx, data)


def build_runner(config, params, loop: str, p: dict):
    from pagedjax.models.layer_loop import ENV_LAYER_LOOP

    from pagedjax.worker.runner import Runner, RunnerConfig

    blocks = max(p["rows"]) * -(-p["context"] // BLOCK) + 2
    with env(ENV_LAYER_LOOP, loop):
        sizes = RunnerConfig(
            num_blocks=blocks,
            block_size=BLOCK,
            max_model_len=p["context"] + BLOCK,
            max_num_seqs=max(p["rows"]),
        )
        return Runner(config, params, sizes)


@contextlib.contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def decode_batch(config, m: int, context: int, row=None):
    """``m`` decode sequences, each at ``context`` tokens, each in its own blocks."""
    from pagedjax.worker.input_batch import ScheduledSeq
    from pagedjax.worker.sampler import SamplingRow

    pages = -(-context // BLOCK)
    row = row or SamplingRow()
    return [
        ScheduledSeq(
            [3 + i % (config.vocab_size - 3)],
            context - 1,
            list(range(1 + i * pages, 1 + (i + 1) * pages)),
            samples=[row],
        )
        for i in range(m)
    ]


class CallTimer:
    """Observes a runner's device calls (``DeviceCalls.observer``): (op, args, call start, call
    return, output) of the last one."""

    def __init__(self, runner):
        self.last = None
        runner.calls.observer = self

    def __call__(self, op, args, start, returned, out):
        self.last = (op, args, start, returned, out)


def timed_dispatch(runner, seqs, num_top: int = 0) -> tuple[float, float]:
    """Median (ms until the step program's call returns, ms until its output is ready)."""
    timer = runner.calls.observer
    if not isinstance(timer, CallTimer):
        timer = CallTimer(runner)
    for _ in range(2):  # compiled, warm
        runner.execute(seqs, num_top)
    back, ready = [], []
    for _ in range(REPEATS):
        handle = runner.dispatch(seqs, num_top)
        _, _, start, returned, _ = timer.last
        jax.block_until_ready((handle.out, handle.tokens))
        back.append(returned - start)
        ready.append(time.perf_counter() - start)
        runner.fetch(handle)
    return 1e3 * statistics.median(back), 1e3 * statistics.median(ready)


def loop_row(runner, config, loop: str, m: int, context: int, copy: float) -> dict:
    """One step of ``m`` sequences back to back on its prepared inputs: ms per step, and that
    as a fraction of the memory floor."""
    from pagedjax.models.layer_loop import is_per_layer

    from pagedjax.inspection.step_profile import model_read_bytes

    seqs = decode_batch(config, m, context)
    timed_dispatch(runner, seqs)  # compiled; the timer holds the step's arguments
    op, args, *_ = runner.calls.observer.last
    n = 3 * REPEATS
    run = runner.device_op(op)
    start = time.perf_counter()
    for _ in range(n):
        out = run(*args)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - start) / n
    weights, page = model_read_bytes(runner)
    step_bytes = weights + m * -(-context // BLOCK) * page
    floor_s = step_bytes / copy
    return dict(
        loop=loop,
        per_layer_weights=is_per_layer(runner.params),
        rows=m,
        step_ms=1e3 * step_s,
        floor_ms=1e3 * floor_s,
        of_floor=floor_s / step_s,
        step_bytes=step_bytes,
    )


def dispatch_rows(runner, config, m: int, context: int) -> list[dict]:
    from pagedjax.worker.sampler import SamplingRow

    cases = (
        ("greedy", SamplingRow(), 0),
        ("sampling top-p", SamplingRow(temperature=1.0, top_p=0.9, seed=1), 0),
        ("penalties", SamplingRow(temperature=1.0, repetition_penalty=1.2, seed=1), 0),
        ("top logprobs", SamplingRow(), 5),
    )
    rows = []
    for name, row, num_top in cases:
        back, ready = timed_dispatch(runner, decode_batch(config, m, context, row), num_top)
        rows.append(dict(variant=name, rows=m, dispatch_ms=back, ready_ms=ready))
    return rows


def cond_control(n: int) -> dict:
    """A jitted n x n bf16 matmul, plain and with a ``lax.cond`` on its result: ms until the call
    returns and until ready (on a GPU the cond's call returns only when the device is done)."""
    x = jnp.ones((n, n), jnp.bfloat16)
    plain = jax.jit(lambda x: x @ x)
    cond = jax.jit(lambda x: jax.lax.cond((y := x @ x)[0, 0] > 0, lambda: y + 1, lambda: y))
    out = {}
    for name, fn in (("plain", plain), ("cond", cond)):
        jax.block_until_ready(fn(x))
        back, ready = [], []
        for _ in range(REPEATS):
            start = time.perf_counter()
            y = fn(x)
            back.append(time.perf_counter() - start)
            jax.block_until_ready(y)
            ready.append(time.perf_counter() - start)
        out[name] = dict(dispatch_ms=1e3 * min(back), ready_ms=1e3 * min(ready))
    return out


def print_dispatch(data: dict) -> None:
    say(f"  {'program':28s} {'rows':>4s} {'dispatch ms':>11s} {'ready ms':>9s}")
    for r in data["dispatch"]:
        say(
            f"  {'step + ' + r['variant']:28s} {r['rows']:4d} {r['dispatch_ms']:11.3f}"
            f" {r['ready_ms']:9.3f}"
        )
    for name, r in data["control"].items():
        say(
            f"  {'control matmul, ' + name:28s} {'':4s} {r['dispatch_ms']:11.3f}"
            f" {r['ready_ms']:9.3f}"
        )


def verdict(ctx: Context, data: dict) -> tuple[bool, str]:
    """On a device: every step variant's call returns before HOST_WAIT of its ready time."""
    waits = [r["variant"] for r in data["dispatch"] if r["dispatch_ms"] > HOST_WAIT * r["ready_ms"]]
    data["host_waits"] = waits
    of_floor = {f"{r['loop']} M={r['rows']}": round(r["of_floor"], 2) for r in data["layer_loop"]}
    control = data["control"]["cond"]
    summary = (
        f"{data['layers']} layers, of the memory floor: "
        + ", ".join(f"{k} {v}" for k, v in of_floor.items())
        + f"; host waits in: {', '.join(waits) or 'none'}"
        + f" (control cond: {control['dispatch_ms']:.2f} of {control['ready_ms']:.2f} ms)"
    )
    if ctx.interpret:
        return True, summary + TOY_NOTE
    return not waits, summary
