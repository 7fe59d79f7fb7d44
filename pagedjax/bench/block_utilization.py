"""KV memory utilisation: paged blocks vs a contiguous max-length reservation, same budget.

    python -m pagedjax.bench.block_utilization [--num-requests N] [--block-size B]
        [--max-model-len L] [--seed S] [--num-blocks K]

Simulates a seeded ShareGPT-like workload without a model. Paged: the engine's own Scheduler and
BlockManager admit requests first come, first served while memory allows, give each request
blocks as it grows, preempt the latest-arrived by recompute on a dry pool (as vLLM does); every
running request gains one token per step and leaves when its output is complete. Contiguous: each
request reserves max_model_len slots up front, as Orca-style systems do. Utilisation is tokens
stored / slots allocated, summed over every step. Pure Python; imports no jax.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import deque

import numpy as np

from pagedjax.bench.workload import RequestLengths, sharegpt_like
from pagedjax.config import SchedulerConfig
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceGroup
from pagedjax.sampling_params import SamplingParams
from pagedjax.utils import cdiv


@dataclasses.dataclass(frozen=True)
class SimResult:
    kv_utilization: float  # tokens stored / slots allocated, summed over steps
    max_concurrent: int  # most requests running in one step
    mean_concurrent: float
    num_steps: int
    num_preemptions: int


class _Picks:
    """What the scheduler reads from a step's sampler: token 0 for every row."""

    def __init__(self, num_rows: int):
        self.tokens = np.zeros(num_rows, np.int32)
        self.logprobs = np.zeros(num_rows, np.float32)
        self.top_token_ids = np.zeros((num_rows, 1), np.int32)
        self.top_logprobs = np.zeros((num_rows, 1), np.float32)


def simulate_paged(
    workload: list[RequestLengths],
    *,
    block_size: int,
    num_blocks: int,
    watermark: float = 0.01,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 1 << 16,
) -> SimResult:
    """The engine's own Scheduler and BlockManager, run without a model: every step's chunks are
    taken as computed and every sample is token 0, so only the memory behaviour is simulated."""
    bm = BlockManager(num_blocks, block_size, watermark=watermark)
    sched = Scheduler(
        bm,
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode="recompute",
        ),
    )
    for i, r in enumerate(workload):
        if cdiv(r.prompt_len + r.output_len - 1, block_size) > num_blocks - 1 - bm.watermark_blocks:
            raise ValueError(f"request {i} never fits {num_blocks} blocks")
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        seq = Sequence(sched.new_seq_id(), [0] * r.prompt_len, block_size)
        sched.add(SequenceGroup(str(i), [seq], arrival_time=i, sampling_params=params))
    steps = concurrent = max_concurrent = 0
    while sched.has_unfinished():
        out = sched.schedule()
        if out.aborted:
            raise ValueError(f"the scheduler aborted {out.aborted[0].abort_reason}")
        num_running = len(sched.running)
        max_concurrent = max(max_concurrent, num_running)
        concurrent += num_running
        steps += 1
        sched.update_from_output(out.chunks, _Picks(sum(c.num_samples for c in out.chunks)))
        bm.record_usage()
        sched.drop_finished()
    return SimResult(
        kv_utilization=bm.get_stats().kv_utilization,
        max_concurrent=max_concurrent,
        mean_concurrent=concurrent / max(steps, 1),
        num_steps=steps,
        num_preemptions=sched.num_preemptions,
    )


def simulate_contiguous(
    workload: list[RequestLengths], *, max_model_len: int, num_slots: int
) -> SimResult:
    if num_slots < max_model_len:
        raise ValueError(f"{num_slots} slots cannot reserve one max_model_len={max_model_len}")
    waiting = deque(range(len(workload)))
    lens: dict[int, int] = {}  # running request -> tokens held
    steps = concurrent = max_concurrent = 0
    tokens_stored = slots_allocated = 0
    while waiting or lens:
        while waiting and (len(lens) + 1) * max_model_len <= num_slots:
            i = waiting.popleft()
            lens[i] = workload[i].prompt_len
        max_concurrent = max(max_concurrent, len(lens))
        concurrent += len(lens)
        steps += 1
        for i in list(lens):
            lens[i] += 1
            if lens[i] - workload[i].prompt_len == workload[i].output_len:
                del lens[i]
        tokens_stored += sum(lens.values())
        slots_allocated += len(lens) * max_model_len
    return SimResult(
        kv_utilization=tokens_stored / slots_allocated if slots_allocated else 0.0,
        max_concurrent=max_concurrent,
        mean_concurrent=concurrent / max(steps, 1),
        num_steps=steps,
        num_preemptions=0,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pagedjax.bench.block_utilization", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-blocks", type=int, default=2048, help="device blocks, the null block included"
    )
    args = parser.parse_args(argv)

    workload = sharegpt_like(args.num_requests, max_model_len=args.max_model_len, seed=args.seed)
    num_slots = (args.num_blocks - 1) * args.block_size
    paged = simulate_paged(workload, block_size=args.block_size, num_blocks=args.num_blocks)
    contiguous = simulate_contiguous(
        workload, max_model_len=args.max_model_len, num_slots=num_slots
    )

    prompt_mean = sum(r.prompt_len for r in workload) / max(len(workload), 1)
    output_mean = sum(r.output_len for r in workload) / max(len(workload), 1)
    print(
        f"workload: {len(workload)} ShareGPT-like requests (seed {args.seed}), mean prompt "
        f"{prompt_mean:.1f}, mean output {output_mean:.1f} tokens, max_model_len "
        f"{args.max_model_len}"
    )
    print(f"KV budget: {args.num_blocks - 1} blocks x {args.block_size} = {num_slots} slots")
    header = f"paged (block {args.block_size})"
    contiguous_header = f"contiguous ({args.max_model_len})"
    rows = [
        ("tokens stored / slots allocated", "{:.4f}", "kv_utilization"),
        ("max concurrent requests", "{}", "max_concurrent"),
        ("mean concurrent requests", "{:.1f}", "mean_concurrent"),
        ("steps to drain the workload", "{}", "num_steps"),
        ("preemptions (recompute)", "{}", "num_preemptions"),
    ]
    print(f"{'':34}{header:>20}{contiguous_header:>20}{'ratio':>10}")
    for label, fmt, field in rows:
        a, b = getattr(paged, field), getattr(contiguous, field)
        ratio = f"{a / b:.2f}x" if b else "-"
        print(f"{label:34}{fmt.format(a):>20}{fmt.format(b):>20}{ratio:>10}")


if __name__ == "__main__":
    main()
