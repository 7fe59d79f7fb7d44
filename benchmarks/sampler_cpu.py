"""The sampler program (the logits rows gathered, then ``sample``), on one batch of greedy rows,
three ways in one process, interleaved:

  * branchless: what a greedy batch compiles to (``SamplingInput.penalties`` and ``.random``
    false: no conditional around the logits);
  * with branches: the same rows with both flags forced on (the penalty and draw work done,
    then discarded for these greedy rows: what a batch with one penalised or sampling row runs);
  * branchless with ``jnp.argmax``: the sampler's own ``argmax`` swapped for XLA's.

    python benchmarks/sampler_cpu.py [--rows 64] [--vocab 49152] [--repeats 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from pagedjax.worker import sampler  # noqa: E402
from pagedjax.worker.sampler import SamplingInput, SamplingRow  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    n, vocab = args.rows, args.vocab
    greedy = SamplingInput.build([SamplingRow(position=i) for i in range(n)], n, vocab)
    branches = greedy.replace(penalties=True, random=True)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((n, vocab), np.float32))
    rows = jnp.arange(n, dtype=jnp.int32)

    def program(argmax):  # the sampler program, traced now with this argmax
        def step(logits, rows, s):  # a function of its own: jax caches traces by function
            return sampler.sample(logits[rows], s)

        sampler.argmax, own = argmax, sampler.argmax
        try:
            return jax.jit(step).lower(logits, rows, greedy).compile()
        finally:
            sampler.argmax = own

    sample = program(sampler.argmax)
    cases = {
        "branchless": (sample, greedy),
        "with branches": (jax.jit(lambda x, r, s: sampler.sample(x[r], s)), branches),
        "branchless, jnp.argmax": (program(lambda x: jnp.argmax(x, axis=-1)), greedy),
    }
    outs = {k: jax.block_until_ready(f(logits, rows, s)) for k, (f, s) in cases.items()}
    for k, out in outs.items():  # the same tokens and logprobs every way
        np.testing.assert_array_equal(out.tokens, outs["branchless"].tokens, err_msg=k)
        np.testing.assert_array_equal(out.logprobs, outs["branchless"].logprobs, err_msg=k)
    times = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, (f, s) in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(logits, rows, s))
            times[k].append(time.perf_counter() - t0)
    print(f"sampler program, {n} greedy rows x {vocab} logits (ms)")
    print(f"{'program':26s}{'min':>8s}{'median':>9s}")
    for k, ts in times.items():
        print(f"{k:26s}{min(ts) * 1e3:8.2f}{statistics.median(ts) * 1e3:9.2f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
