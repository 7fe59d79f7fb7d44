"""What detokenizing one decode step costs the engine thread: the incremental windows of B
sequences (vLLM's: a prefix window and a full window per sequence, here 5 and 6 tokens) decoded
one by one with ``tokenizer.decode`` (the engine before OutputProcessor.check_stops) against the
whole step's windows in two batched calls (``OutputProcessor.detokenize_many``), with the
embedded SmolLM2 tokenizer. Prints ms per step (min and median of repeats) and the ratio, and
checks that both give the same text.

    python benchmarks/detokenize_step.py [--batch 64] [--steps 50] [--repeats 7]

Time it on a quiet machine (``uptime`` first).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from pagedjax.models.loader import default_model_path  # noqa: E402
from pagedjax.models.loading.tokenizer import cached_gguf_tokenizer  # noqa: E402

from pagedjax.core.sequence import Sequence  # noqa: E402
from pagedjax.engine.output_processor import OutputProcessor  # noqa: E402


def sequences(batch: int, vocab: int, seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    return [Sequence(i, [rng.randrange(200, vocab) for _ in range(16)], 16) for i in range(batch)]


def run(proc: OutputProcessor, batch: int, steps: int, batched: bool, vocab: int) -> float:
    """Seconds for ``steps`` decode steps of ``batch`` fresh sequences (same tokens each run)."""
    seqs = sequences(batch, vocab, seed=0)
    rng = random.Random(1)
    tokens = [[rng.randrange(200, vocab) for _ in seqs] for _ in range(steps)]
    start = time.perf_counter()
    for step in tokens:
        for seq, t in zip(seqs, step, strict=True):
            seq.append_token_id(t)
        if batched:
            proc.detokenize_many([(s, True) for s in seqs])
        else:
            for s in seqs:
                proc.detokenize(s, True)
    elapsed = time.perf_counter() - start
    run.texts = [s.text for s in seqs]
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    tok = cached_gguf_tokenizer(Path(default_model_path()))
    proc = OutputProcessor(tok, eos_token_ids=set())
    vocab = len(tok)
    times = {False: [], True: []}
    texts = {}
    for _ in range(args.repeats):  # alternating, so that drift hits both
        for batched in (False, True):
            times[batched].append(run(proc, args.batch, args.steps, batched, vocab) / args.steps)
            texts[batched] = run.texts
    assert texts[False] == texts[True], "batched detokenization gave another text"
    one, many = (1e3 * min(times[False]), 1e3 * min(times[True]))
    print(f"batch {args.batch}, {args.steps} steps x {args.repeats} repeats, same text: yes")
    for name, batched in (("one by one", False), ("batched", True)):
        t = times[batched]
        print(f"  {name:10s} min {1e3 * min(t):.3f} ms  median {1e3 * statistics.median(t):.3f} ms")
    print(f"  batched / one by one (min): {many / one:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
