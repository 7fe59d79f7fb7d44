"""The programs a runner's steps can need, as warm-up jobs (name, lowering thunk).

Each program is lowered with arguments placed as the steps place theirs (``Runner.place``), so
what warm-up compiles is what the steps call (committed and uncommitted arguments differ).
``startup_jobs``: the bucket policy's common programs (worker/warmup.py's ``common_shapes``),
compiled before a server answers; ``warmup_jobs``: every program within a workload's limits.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np

from pagedjax.spec_decode.rejection import verify_step
from pagedjax.utils import next_pow2, powers_of_two
from pagedjax.worker import programs, prompt_logprobs, sampler, step_program
from pagedjax.worker.input_batch import StepShape
from pagedjax.worker.sampler import SamplingInput
from pagedjax.worker.warmup import Job, common_shapes

PROMPT_ROWS = "prompt rows"  # in the name of a job whose program scores prompt rows
# A request that sets nothing, without sampling defaults from the model: temperature alone
DEFAULT_SAMPLING = sampler.Variant(random=True)


@functools.cache
def _default_sampler(default: sampler.Variant) -> re.Pattern:
    return re.compile(rf"(step \S.* sampler|sampler s\d+) {re.escape(str(default))}")


def plain_traffic(name: str, default: sampler.Variant = DEFAULT_SAMPLING) -> bool:
    """Whether the job ``name`` compiles a program that plain requests run: a model step (which
    samples a greedy batch itself), a decode step that samples ``default`` rows (the sampler
    variant of a request that sets nothing), or the sampler of such rows (after a prefill)."""
    if name.startswith("model "):
        return PROMPT_ROWS not in name
    return _default_sampler(default).fullmatch(name) is not None


def startup_jobs(
    runner,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    default: sampler.Variant = DEFAULT_SAMPLING,
) -> list[Job]:
    """The step program of each common model shape (which samples a plain greedy batch and fills
    async placeholders itself), the step program of each common decode shape that samples
    ``default`` rows itself, and the sampler of such a request for each of their sequence
    buckets (a prefill step's); with a greedy ``default``, the model steps alone."""
    shapes = runner.step_shapes(max_num_seqs, max_num_batched_tokens)
    common = common_shapes(runner.batcher, shapes)
    jobs = [(f"model {s}", lambda s=s: lower_step(runner, s)) for s in common]
    jobs += lora_jobs(runner)
    if default == sampler.Variant():  # plain greedy: sampled in the step programs
        return jobs
    for s in common if step_program.samples_in_step(default) else ():
        if s.max_query_len == 1:  # a decode step sampling default rows: one program
            jobs.append((_step_name(s, default), lambda s=s: lower_step(runner, s, default)))
    for s in sorted({shape.num_seqs for shape in common}):  # named as in warmup_jobs: done once
        name = f"sampler s{s} {default}"
        jobs.append((name, lambda s=s: lower_sample(runner, s, default)))
    return jobs


def warmup_jobs(
    runner, max_num_seqs: int, max_num_batched_tokens: int, swap: bool | None = None
) -> list[Job]:
    """Each model-step shape, each decode shape's step program with each sampler variant it can
    hold (``step_program.step_variants``), the sampler for each sequence bucket in each of its
    variants (penalties, logit bias or allowed-token masks, greedy or sampling), the block
    copy / swap programs (``swap`` None: if the runner has host blocks), and last each prefill
    shape's programs that score prompt rows (``prompt_rows_jobs``)."""
    jobs = lora_jobs(runner)
    shapes = runner.step_shapes(max_num_seqs, max_num_batched_tokens)
    for shape in shapes:
        jobs.append((f"model {shape}", lambda shape=shape: lower_step(runner, shape)))
    for shape in shapes:
        for variant in step_program.step_variants() if shape.max_query_len == 1 else ():
            args = (shape, variant)
            jobs.append((_step_name(*args), lambda a=args: lower_step(runner, *a)))
    for s in sorted({shape.num_seqs for shape in shapes}):
        for variant in sampler.variants():  # static flags, e.g. greedy or not
            for v in (False, True) if runner.num_speculative_tokens else (False,):
                if variant == sampler.Variant() and not v:
                    continue  # plain greedy: sampled in the step program
                name = f"sampler s{s} {variant}" + " verify" * v  # v: can verify proposals
                args = (s, variant, v)
                jobs.append((name, lambda a=args: lower_sample(runner, *a)))
    swap = runner.num_host_blocks > 0 if swap is None else swap
    max_moves = next_pow2(min(runner.num_blocks, max_num_seqs * runner.max_blocks_per_seq), 8)
    lower_move = runner.kv_cache.lower_block_op
    for n in powers_of_two(8, max_moves):
        ids = np.full(n, -1, np.int32)
        for op in ("copy", "gather", "scatter") if swap else ("copy",):
            jobs.append((f"{op}_blocks {n}", lambda op=op, ids=ids: lower_move(op, ids)))
    return jobs + prompt_rows_jobs(runner, shapes)


def prompt_rows_jobs(runner, shapes: list[StepShape]) -> list[Job]:
    """The step program of each prefill shape with each block of prompt rows it can score
    (prompt logprobs, worker/prompt_logprobs.py's ``rows_buckets``); named "... prompt rows",
    the rarest programs, compiled last."""
    jobs = []
    for shape in shapes:
        if shape.max_query_len > 1:
            for p in prompt_logprobs.rows_buckets(shape.num_tokens):
                name = f"model {shape} {PROMPT_ROWS} p{p}"
                jobs.append((name, lambda a=(shape, None, p): lower_step(runner, *a)))
    return jobs


def lora_jobs(runner) -> list[Job]:
    """The LoRA slot write (an engine serving adapters: changing them compiles nothing)."""
    return [] if runner.lora_slots is None else [("lora slot write", runner.lower_slot_write)]


def _step_name(shape: StepShape, variant: sampler.Variant) -> str:
    return f"step {shape} sampler {variant}"


def lower_step(
    runner, shape: StepShape, variant: sampler.Variant | None = None, prompt_rows: int = 0
):
    """The step program of a model shape (its logits rows all sampled), sampling ``variant``
    itself when given (a sampled decode step), else greedily; with ``prompt_rows`` more logits
    rows, scored for prompt logprobs."""
    empty = runner.batcher.empty(shape)
    rows = np.zeros(len(empty.logits_indices), np.int32)
    sampling = None
    if variant is not None:
        sampling = runner.sampling_input([variant.row()], len(rows), int(variant.top_logprobs))
        assert sampling.variant == variant, (sampling.variant, variant)
    targets = None
    if prompt_rows:
        indices = np.zeros(len(rows) + prompt_rows, np.int32)
        empty = empty.replace(logits_indices=indices)
        targets = np.zeros(prompt_rows, np.int32)
    packed, layout = step_program.pack_inputs(empty, rows, sampling, targets)
    return programs.step.lower(
        runner.params,
        runner.kv_cache.pages,
        packed,  # a host array, as the steps pass it (Runner._host)
        runner.place(np.zeros(runner.fill_width, np.int32)),
        runner.config,
        runner.backend,
        runner.mesh,
        runner.linear,
        layout,
        runner.lora_slots,
    )


def lower_sample(runner, num_seqs: int, variant: sampler.Variant, verify: bool = False):
    """The sampler of a variant for ``num_seqs`` sequences (``verify``: the verify program)."""
    size = num_seqs * runner.batcher.logits_per_step(decode=not verify)  # its logits rows
    sampling = runner.sampling_input([variant.row()], size, int(variant.top_logprobs))
    assert sampling.variant == variant, (sampling.variant, variant)
    if not verify:
        return _lower_sampler(runner, sampling)
    args = (
        _logits_like(runner, size),
        runner.place(np.zeros(size, np.int32)),
        runner.place(sampling),
        runner.place(np.full(size, -1, np.int32)),
    )
    if runner.verifies_draft_probs:
        args += (_logits_like(runner, size),)  # q: placed like the logits
    return verify_step.lower(*args)


def _lower_sampler(runner, sampling: SamplingInput):
    packed, layout = step_program.pack_sampling(sampling)
    logits = _logits_like(runner, len(sampling.temperature))
    return programs.sample.lower(logits, runner.place(packed), layout, runner.fill_width)


def _logits_like(runner, num_seqs: int) -> jax.Array:
    """An array placed like the model step's logits, so the sampler compiled here is the one the
    steps call."""
    return runner.place(np.zeros((num_seqs, runner.config.vocab_size), np.float32))
