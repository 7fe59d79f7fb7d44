"""The engine's own cost per step: decode steps of a model whose compute is negligible (2 layers,
hidden 64, a 256-token vocabulary, random weights, no tokenizer), so what a step costs is the
engine's host work (scheduling, building and packing inputs, dispatching, fetching, updating) and
the dispatch overhead of its programs. At batch 1 and 64, with async scheduling on and off:
ms per decode step (min and median over repeats of a block of steps) and, from the same run, the
programs dispatched and the host arrays transferred per step (the runner's counts).

    python benchmarks/engine_host_cost.py [--steps 32] [--repeats 7] [--batches 1 64] [--quick]
                                          [--sampled] [--final-only]

Time it on a quiet machine: other jobs' load shows up directly in these figures. To compare with
an older checkout in the same sitting, run this same file from that checkout's root, with
``pagedjax/models`` and ``pagedjax/pallas_kernels`` linked to its ``models/`` and
``pallas_kernels/`` so that its own package is imported (its counts print as nan).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from pagedjax.models.config import ModelConfig  # noqa: E402
from pagedjax.models.llama import param_shapes  # noqa: E402
from pagedjax.models.loader import LoadedModel  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402

PROMPT_LEN = 8
BLOCK_SIZE = 16


def tiny_model() -> LoadedModel:
    config = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: (
            np.ones(s.shape, s.dtype)
            if "norm" in jax.tree_util.keystr(path)
            else (0.02 * rng.standard_normal(s.shape)).astype(s.dtype)
        ),
        param_shapes(config, "float32"),
    )
    return LoadedModel(config=config, params=params, source="engine-host-cost", tokenizer_dir=None)


def make_llm(loaded: LoadedModel, batch: int, max_model_len: int, async_scheduling: bool) -> LLM:
    """An LLM over in-memory weights (LLM takes a path: its loader hands back ``loaded``)."""
    module = sys.modules[LLM.__module__]
    original = module.load_model
    module.load_model = lambda *a, **k: loaded
    try:
        return LLM(
            loaded.source,
            dtype="float32",
            block_size=BLOCK_SIZE,
            max_model_len=max_model_len,
            max_num_seqs=batch,
            max_num_batched_tokens=max(batch * PROMPT_LEN, 64),
            num_blocks=batch * -(-max_model_len // BLOCK_SIZE) + 8,
            async_scheduling=async_scheduling,
        )
    finally:
        module.load_model = original


def measure(
    llm: LLM, batch: int, steps: int, repeats: int, sampled: bool = False, final_only=False
) -> dict:
    """Per-step ms (each repeat times ``steps`` decode steps) and per-step counts. ``sampled``:
    every request samples (temperature 0.8, top-p 0.9, its own seed), else greedy.
    ``final_only``: the requests ask for their final output alone (``LLM.generate``'s), else
    for every step's (a server's)."""
    engine, runner = llm.engine, llm.engine.runner
    max_tokens = steps * (repeats + 1) + 4
    if sampled:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if final_only:
        from pagedjax import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
    rng = np.random.default_rng(batch)
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(3, 250, PROMPT_LEN).tolist(), params)
    for _ in range(steps):  # prompts, then decode steps: every program compiled (discarded)
        engine.step()
    times = []
    programs, transfers = _counts(runner)
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times.append((time.perf_counter() - t0) / steps)
    n = steps * repeats
    for i in range(batch):
        engine.abort_request(f"r{i}")
    programs_after, transfers_after = _counts(runner)
    return dict(
        min_ms=min(times) * 1e3,
        median_ms=statistics.median(times) * 1e3,
        programs=(programs_after - programs) / n,
        transfers=(transfers_after - transfers) / n,
    )


def _counts(runner) -> tuple[float, float]:
    """The runner's program and transfer counts; NaN for a runner that does not count them (an
    older checkout, timed side by side with this one: see the module docstring)."""
    nan = float("nan")
    return getattr(runner, "num_programs", nan), getattr(runner, "num_transfers", nan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32, help="decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--quick", action="store_true", help="a few steps: checks that it runs")
    parser.add_argument(
        "--sampled", action="store_true", help="also time batches that sample (temperature 0.8)"
    )
    parser.add_argument(
        "--final-only",
        action="store_true",
        help="also time greedy batches whose requests ask for their final output alone "
        "(RequestOutputKind.FINAL_ONLY, what LLM.generate asks for), async scheduling on",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 4, 2
    print(f"load average {os.getloadavg()[0]:.2f} at the start; jax {jax.__version__} on "
          f"{jax.default_backend()}")  # fmt: skip
    loaded = tiny_model()
    max_model_len = PROMPT_LEN + args.steps * (args.repeats + 2) + 8
    print(f"{'rows':>7s} {'batch':>5s} {'async':>5s} {'outputs':>7s} {'min ms':>8s} "
          f"{'median ms':>10s} {'programs':>9s} {'transfers':>10s}  (per decode step)")  # fmt: skip
    runs = [(s, b, a, False) for s in (False, True)[: 1 + args.sampled] for b in args.batches
            for a in (True, False)]  # fmt: skip
    runs += [(False, b, True, True) for b in args.batches if args.final_only]
    for sampled, batch, async_scheduling, final_only in runs:
        llm = make_llm(loaded, batch, max_model_len, async_scheduling)
        try:
            r = measure(llm, batch, args.steps, args.repeats, sampled, final_only)
        finally:
            llm.close()
        print(
            f"{'sampled' if sampled else 'greedy':>7s} {batch:5d} "
            f"{'on' if async_scheduling else 'off':>5s} {'final' if final_only else 'every':>7s} "
            f"{r['min_ms']:8.3f} {r['median_ms']:10.3f} {r['programs']:9.2f} "
            f"{r['transfers']:10.2f}"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
