"""Where a decode step's time goes on this machine: attention against the rest, and both against
the time to stream the parameters once (the floor for a memory-bound step).

For the model (default: the embedded SmolLM2-135M), each batch size and context length, times the
engine's own decode-step program (``runner.forward``: the model step without sampling, as the
engine buckets it) three ways, one after the other in one process:

- ``full``: as the engine runs it;
- ``no attention``: the same program with the paged attention replaced by ``q`` itself (what is
  left: the linear layers, norms, rope, the KV writes, the layer scan's per-layer weight slices,
  the LM head). Its outputs are meaningless; only its time is used;
- ``stream``: one pass over every parameter (a reduction over each, one program), the least any
  step that reads the weights can take.

Attention's share is ``1 - no_attention / full``. Then (unless ``--no-scan-toy``) what the
layer scan itself costs: a 30-layer stack of two matmuls (576 -> 1536 -> 576, 212 MB of float32
weights) on one row, under ``lax.scan`` over stacked weights and as a Python loop over separate
arrays in one program and with one layer program dispatched per layer (XLA on CPU copies each
layer's slice of a stacked array before its dot). Median of
``--repeats`` timings of ``--calls`` back-to-back calls each. Check the load first (``uptime``);
the script prints it.

    python benchmarks/decode_step_breakdown.py [--batches 1 8 64] [--contexts 100 200] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time


def _timed(fn, calls: int, repeats: int) -> float:
    """Median seconds per call over ``repeats`` runs of ``calls`` back-to-back calls."""
    import jax

    jax.block_until_ready(fn())  # compile / warm
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


@contextlib.contextmanager
def _attention_stubbed():
    """The CPU backend's decode attention (every path: native, one pass, chunked) replaced by
    ``q`` itself while inside; the step programs are traced again on entry and on exit."""
    import jax
    from pagedjax.pallas_kernels import NativeBackend

    real = NativeBackend.decode
    NativeBackend.decode = lambda self, q, *a, **k: q
    jax.clear_caches()
    try:
        yield
    finally:
        NativeBackend.decode = real
        jax.clear_caches()


def scan_toy(calls: int, repeats: int, layers: int = 30, d: int = 576, f: int = 1536) -> dict:
    """Seconds per call of a stack of ``layers`` (x + tanh(x @ a) @ b) on one row: under
    ``lax.scan`` over stacked weights, unrolled over separate per-layer arrays in one program,
    and one layer program dispatched from Python per layer (separate arrays)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    w1 = jnp.asarray(0.02 * rng.standard_normal((layers, d, f), np.float32))
    w2 = jnp.asarray(0.02 * rng.standard_normal((layers, f, d), np.float32))
    x = jnp.asarray(rng.standard_normal((1, d), np.float32))

    def layer(h, w):
        return h + jnp.tanh(h @ w[0]) @ w[1], None

    scanned = jax.jit(lambda x, w1, w2: jax.lax.scan(layer, x, (w1, w2))[0])
    separate = [(w1[i], w2[i]) for i in range(layers)]

    def unrolled(x, ws):
        for w in ws:
            x = layer(x, w)[0]
        return x

    unrolled = jax.jit(unrolled)
    one_layer = jax.jit(lambda x, w: layer(x, w)[0])

    def host_loop(x, ws):  # one program per layer, dispatched from Python
        for w in ws:
            x = one_layer(x, w)
        return x

    out = dict(
        scan_s=_timed(lambda: scanned(x, w1, w2), calls, repeats),
        loop_s=_timed(lambda: unrolled(x, separate), calls, repeats),
        host_loop_s=_timed(lambda: host_loop(x, separate), calls, repeats),
        weight_bytes=w1.nbytes + w2.nbytes,
    )
    print(
        f"layer-scan toy ({layers} layers, {out['weight_bytes'] / 1e6:.0f} MB, one row): "
        f"scan {out['scan_s'] * 1e3:.1f} ms, loop over separate arrays {out['loop_s'] * 1e3:.1f} "
        f"ms (ratio {out['scan_s'] / out['loop_s']:.2f}), one layer program dispatched per "
        f"layer {out['host_loop_s'] * 1e3:.1f} ms"
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-scan-toy", dest="scan_toy", action="store_false")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax import LLM
    from pagedjax.worker.runner import ScheduledSeq

    print(f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    llm = LLM(args.model, max_model_len=max(args.contexts) + 16, max_num_seqs=max(args.batches))
    runner, bs = llm.runner, llm.runner.block_size

    leaves = jax.tree.leaves(runner.params)
    nbytes = sum(x.nbytes for x in leaves)
    stream = jax.jit(lambda ps: sum(jnp.sum(p.astype(jnp.float32)) for p in ps))
    t_stream = _timed(lambda: stream(leaves), args.calls, args.repeats)
    print(
        f"parameters {nbytes / 1e6:.0f} MB: read once {t_stream * 1e3:.1f} ms "
        f"({nbytes / t_stream / 1e9:.1f} GB/s)",
        flush=True,
    )

    rows = []
    print(f"{'batch':>5} {'context':>7} {'full ms':>8} {'no attn ms':>10} {'attn share':>10}")
    for ctx in args.contexts:
        for b in args.batches:
            nblk = -(-(ctx + 1) // bs)
            seqs = [
                ScheduledSeq([5], ctx, list(range(1 + i * nblk, 1 + (i + 1) * nblk)))
                for i in range(b)
            ]
            if b * nblk >= runner.num_blocks:
                print(f"{b:>5} {ctx:>7}  skipped: {b * nblk} blocks, pool {runner.num_blocks}")
                continue
            step = lambda s=seqs: runner.forward(s)  # noqa: E731
            times, logits = {}, {}
            for variant in ("full", "no attention"):
                stub = contextlib.nullcontext() if variant == "full" else _attention_stubbed()
                with stub:
                    times[variant] = _timed(step, args.calls, args.repeats)
                    logits[variant] = np.asarray(step())
            if np.array_equal(logits["full"], logits["no attention"]):
                raise RuntimeError("the attention stub did not reach the decode step")
            full, rest = times["full"], times["no attention"]
            row = dict(batch=b, context=ctx, full_ms=full * 1e3, no_attention_ms=rest * 1e3)
            row["attention_share"] = share = 1 - rest / full
            rows.append(row)
            print(f"{b:>5} {ctx:>7} {full * 1e3:>8.1f} {rest * 1e3:>10.1f} {share:>10.2f}")
    toy = scan_toy(args.calls, args.repeats) if args.scan_toy else None
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(param_bytes=nbytes, stream_s=t_stream, rows=rows, scan_toy=toy), f, indent=1
            )
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
