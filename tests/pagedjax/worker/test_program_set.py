"""The program set is bounded by design and small: the warm-up's job list, counted without a model
for the embedded SmolLM2-135M and for Llama-3-8B at the server's defaults, on each backend. The
numbers below are the bound docs/BENCHMARKS.md states ("The program set"); the same job list is
what warm-up compiles (tests/pagedjax/test_compilation.py) and what a server's start lists."""

from __future__ import annotations

import collections
import types

import pytest

from pagedjax import pallas_kernels
from pagedjax.config import resolve_max_model_len
from pagedjax.worker.input_batch import InputBatcher
from pagedjax.worker.warmup_jobs import program_kinds, warmup_jobs

# (context, head_dim, the pool's blocks on the target): SmolLM2-135M-Instruct as the server
# sizes it on a CPU (1 GiB of float32 pool), Llama-3-8B on an 80 GB GPU in bfloat16.
SMOLLM2 = (8192, 64, 2730)
LLAMA3_8B = (131072, 128, 27000)


def job_names(model, backend: str, *, max_num_seqs=256, spec=0, swap=True, lora=False):
    """The warm-up's job names for a model at the server's defaults (max_model_len: the context
    capped at 8192; the token budget: max(max_model_len, 2048)), with no weights at all."""
    context, head_dim, num_blocks = model
    max_model_len = resolve_max_model_len(None, context)
    budget = max(max_model_len, 2048)
    attention = pallas_kernels.select_backend(backend, block_size=16, head_dim=head_dim)
    batcher = InputBatcher(
        16,
        max_model_len,
        1 + spec,
        follows_context=attention.follows_context,
        max_num_seqs=max_num_seqs,
    )
    batcher.query_buckets = not attention.follows_rows
    runner = types.SimpleNamespace(
        batcher=batcher,
        step_shapes=batcher.step_shapes,
        num_speculative_tokens=spec,
        num_host_blocks=int(swap),
        num_blocks=num_blocks,
        max_blocks_per_seq=batcher.max_blocks_per_seq,
        kv_cache=types.SimpleNamespace(lower_block_op=None),
        lora=types.SimpleNamespace(lower_write=None) if lora else None,
    )
    return [name for name, _ in warmup_jobs(runner, max_num_seqs, budget, swap)]


@pytest.mark.parametrize(
    "model, backend, bound",
    [
        (SMOLLM2, "native", 119),  # a CPU (1,842 programs before the bound)
        (SMOLLM2, "triton", 174),  # a GPU: query buckets for the ragged kernel's grid
        (LLAMA3_8B, "triton", 177),  # more pool blocks: one more size of block moves
        (LLAMA3_8B, "tpu", 122),  # the TPU ragged kernel tiles packed rows: no query buckets
    ],
)
def test_the_bound_at_the_servers_defaults(model, backend, bound):
    names = job_names(model, backend)
    assert len(names) == len(set(names)) == bound, collections.Counter(program_kinds(names))


def test_what_makes_programs_and_what_does_not():
    base = job_names(SMOLLM2, "native")
    kinds = program_kinds(base)
    # The model's work alone picks model programs: 6 decode and 36 prefill shapes.
    assert kinds["model decode"] == 6 and kinds["model prefill"] == 36
    # Sampling adds three step programs per decode shape and six samplers per sequence bucket:
    # never a multiple of the prefill shapes.
    assert kinds["sampling decode"] == 3 * 6 and kinds["sampler"] == 6 * 6
    # Prompt logprobs: one score program per token bucket.
    assert kinds["score"] == len({n.split()[1] for n in base if n.startswith("score")}) == 11
    # LoRA adds its slot write, speculation a verify program per sampler: no model program.
    assert len(job_names(SMOLLM2, "native", lora=True)) == len(base) + 1
    with_spec = program_kinds(job_names(SMOLLM2, "native", spec=4))
    assert with_spec["sampler"] == 2 * kinds["sampler"]
    assert {k: v for k, v in with_spec.items() if k.startswith("model")} == {
        k: v for k, v in kinds.items() if k.startswith("model")
    }
    # Without swap space, block copies alone.
    assert (
        kinds["block moves"] == 12
        and program_kinds(job_names(SMOLLM2, "native", swap=False))["block moves"] == 4
    )
