"""What sampling costs a decode step of a real model: ms per decode step of the embedded SmolLM2
(a 49,152-token vocabulary) at a batch of 64, greedy and under each kind of sampling (temperature;
top-p; top-k alone; logprobs; penalties), min and median over repeats of a block of steps, in one
process. Run it from two checkouts' roots in one sitting to compare them (link
``pagedjax/models`` and ``pagedjax/pallas_kernels`` to the older one's ``models/`` and
``pallas_kernels/`` as benchmarks/engine_host_cost.py says).

    python benchmarks/decode_sampling_cost.py [--batch 64] [--steps 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from pagedjax import LLM, SamplingParams  # noqa: E402

KINDS = {
    "greedy": {},
    "temperature 0.8": {"temperature": 0.8, "seed": 1},
    "temperature 0.8, top-p 0.9": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
    "temperature 0.8, top-k 50": {"temperature": 0.8, "top_k": 50, "seed": 1},
    "greedy, logprobs 5": {"logprobs": 5},
    "greedy, penalties": {"presence_penalty": 0.5, "repetition_penalty": 1.2},
}


def time_decode(llm: LLM, batch: int, steps: int, repeats: int, params: dict) -> list[float]:
    """ms per decode step over ``repeats`` blocks of ``steps`` steps, the batch decoding."""
    engine = llm.engine
    total = 2 + (repeats + 1) * steps
    sp = SamplingParams(max_tokens=total, ignore_eos=True, **params)
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", [5 + i % 50] * 16, sp)
    for _ in range(2 + steps):  # the prompts, then decode steps compiled and warm
        engine.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times.append(1e3 * (time.perf_counter() - start) / steps)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    llm = LLM(max_model_len=512, max_num_seqs=args.batch, num_blocks=8 * args.batch + 8)
    for kind, params in KINDS.items():
        ms = time_decode(llm, args.batch, args.steps, args.repeats, params)
        print(f"{kind:32s} min {min(ms):8.2f}  median {statistics.median(ms):8.2f} ms/step")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
