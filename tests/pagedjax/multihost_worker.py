"""One process of a multi-process run (or the whole of a single-process one): the same program
on every process, as on a multi-host job. Generates greedy, sampled, beam-search and preempted
(swapped) requests on a tiny Llama with tensor parallelism over every device of every process,
and writes what it saw to OUT_DIR/process{i}.json.

usage: multihost_worker.py MODEL_DIR OUT_DIR NUM_PROCESSES PROCESS_ID PORT
(the caller sets XLA_FLAGS for the devices per process)
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from pagedjax import distributed  # noqa: E402


def main(model_dir: str, out_dir: str, num_processes: int, process_id: int, port: int) -> None:
    if num_processes > 1:
        distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    import jax
    from pagedjax.models.loading import cache

    from pagedjax import LLM, BeamSearchParams, SamplingParams

    # A pool too small for the batch: requests are preempted and swapped to host memory.
    llm = LLM(
        model_dir,
        block_size=8,
        num_blocks=24,
        max_model_len=128,
        preemption_mode="swap",
        swap_space_gib=0.01,
        tensor_parallel_size=jax.device_count(),
    )
    prompts = [[3 + (7 * i + j) % 250 for j in range(6 + 5 * i)] for i in range(6)]
    seen: dict = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "devices": jax.device_count(),
    }
    greedy = llm.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False
    )
    seen["greedy"] = [o.outputs[0].token_ids for o in greedy]
    if llm.engine.is_driver:
        llm.engine.keep_alive()  # an idle driver's ping; followers pass over it
    sampled = llm.generate(
        prompts[:3],
        SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=7, max_tokens=12),
        use_tqdm=False,
    )
    seen["sampled"] = [[c.token_ids for c in o.outputs] for o in sampled]
    beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=6))
    seen["beams"] = [[c.token_ids for c in o.outputs] for o in beams]
    try:
        llm.generate([[5, 6], [10**6]], use_tqdm=False)
    except ValueError as e:
        seen["error"] = str(e)
    text = llm.generate("w5 w6 w7", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    seen["text"] = text[0].outputs[0].text
    # The orbax cache is shared only when every process sees the same directory.
    seen["cache_shared"] = cache.seen_by_all_processes(Path(os.environ["PAGEDJAX_CACHE_DIR"]))
    seen["own_dir_shared"] = cache.seen_by_all_processes(Path(out_dir, f"own{process_id}"))
    stats = llm.get_stats()
    seen["num_preemptions"] = stats.num_preemptions
    seen["num_swapped_out"] = stats.num_swapped_out
    if num_processes > 1:
        seen["channel"] = check_channel(distributed.Channel())
    llm.close()
    try:
        llm.generate([[5, 6]], use_tqdm=False)
    except RuntimeError as e:
        seen["after_close"] = str(e)
    Path(out_dir, f"process{process_id}.json").write_text(json.dumps(seen))


def pickled_size(message) -> int:
    return len(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def check_channel(channel) -> list[bool]:
    """Messages whose pickled size is just under, at and over the first broadcast's capacity,
    and a large one: do followers receive exactly what the driver sent?"""
    seen = []
    for size in (16379, 16380, 16381, 100_000):
        rng = np.random.default_rng(size)
        lengths = [n for n in range(size, size - 64, -1) if pickled_size(b"x" * n) == size]
        message = rng.bytes(lengths[0])  # pickles to exactly ``size`` bytes
        if channel.is_driver:
            channel.send(message)
            seen.append(True)
        else:
            seen.append(channel.recv() == message)
    return seen


if __name__ == "__main__":
    model, out, n, pid, port = sys.argv[1:]
    main(model, out, int(n), int(pid), int(port))
