"""The programs a runner's steps can need, as warm-up jobs (name, lowering thunk): the program
set, bounded by design.

Each program is lowered with arguments placed as the steps place theirs (``Runner.place``), so
what warm-up compiles is what the steps call (committed and uncommitted arguments differ).
``warmup_jobs`` lists every program within a workload's limits; its length is the engine's
bound on programs (``Runner.program_bound``):

- a model step per step shape (input_batch.py's ``step_shapes``: token, sequence and table-width
  buckets, and on kernels whose grids need it the longest query's);
- per decode shape, the step program sampling in each of the ``step_program.step_variants``
  (three: greedy with top logprobs, sampling, sampling with top-k or top-p);
- per sequence bucket, the sampler program in each of ``sampler.variants`` (six: those three
  modes, with or without penalties), twice with speculation (the verify program);
- per token bucket, the score program of prompt logprobs;
- per power of eight of blocks, the block copy (and with swap space the gather and scatter);
- with LoRA, the slot write.

Sampling options, logprob counts, penalty widths, grammars and adapters are data: none of them
makes a model program. ``startup_jobs``: the bucket policy's common programs (worker/warmup.py's
``common_shapes``), compiled before a server answers.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import numpy as np

from pagedjax.worker import programs, prompt_logprobs, sampler, step_program
from pagedjax.worker.input_batch import StepShape, moves_bucket
from pagedjax.worker.lora import slots_of
from pagedjax.worker.rejection import verify_step
from pagedjax.worker.sampler import SamplingInput, Variant
from pagedjax.worker.warmup import Job, common_shapes

SCORE = "score"  # the first word of a score program's job (prompt logprobs)
# A request that sets nothing, without sampling defaults from the model: temperature alone
DEFAULT_SAMPLING = Variant(random=True)


def own_program_variant(variant: Variant) -> Variant:
    """The sampler program's variant of a batch whose rows need ``variant`` (every sampler
    program's input is constrained: worker/sampling_input.py's ``variants``)."""
    return Variant(variant.penalties, True, variant.random, variant.filters)


@functools.cache
def _default_sampler(default: Variant) -> re.Pattern:
    own = own_program_variant(default)
    return re.compile(rf"(step \S.* sampler {re.escape(str(default))}|sampler s\d+ {own})")


def plain_traffic(name: str, default: Variant | None = DEFAULT_SAMPLING) -> bool:
    """Whether the job ``name`` compiles a program that plain requests run: a model step (which
    samples a greedy batch itself), a decode step that samples ``default`` rows (the sampler
    variant of a request that sets nothing; None: plain greedy), or the sampler of such rows
    (after a prefill)."""
    if name.startswith("model "):
        return True
    return default is not None and _default_sampler(default).fullmatch(name) is not None


def startup_jobs(
    runner,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    default: Variant | None = DEFAULT_SAMPLING,
) -> list[Job]:
    """The step program of each common model shape (which samples a plain greedy batch and fills
    async placeholders itself), the step program of each common decode shape that samples
    ``default`` rows itself, and the sampler of such a request for each of their sequence
    buckets (a prefill step's); with a plain greedy ``default`` (None), the model steps alone."""
    shapes = runner.batcher.step_shapes(max_num_seqs, max_num_batched_tokens)
    common = common_shapes(runner.batcher, shapes)
    jobs = [(f"model {s}", lambda s=s: lower_step(runner, s)) for s in common]
    jobs += lora_jobs(runner)
    if default is None:  # plain greedy: sampled in the step programs
        return jobs
    for s in common if step_program.samples_in_step(default) else ():
        if s.max_query_len == 1:  # a decode step sampling default rows: one program
            jobs.append((_step_name(s, default), lambda s=s: lower_step(runner, s, default)))
    own = own_program_variant(default)
    for s in sorted({shape.num_seqs for shape in common}):  # named as in warmup_jobs: done once
        jobs.append((f"sampler s{s} {own}", lambda s=s: lower_sample(runner, s, own)))
    return jobs


def warmup_jobs(
    runner, max_num_seqs: int, max_num_batched_tokens: int, swap: bool | None = None
) -> list[Job]:
    """Every program a workload within these limits can need (the module doc lists them), the
    rarest (score programs) last. ``swap`` None: the swap programs if the runner has host
    blocks."""
    jobs = lora_jobs(runner)
    shapes = runner.batcher.step_shapes(max_num_seqs, max_num_batched_tokens)
    for shape in shapes:
        jobs.append((f"model {shape}", lambda shape=shape: lower_step(runner, shape)))
    for shape in shapes:
        for variant in step_program.step_variants() if shape.max_query_len == 1 else ():
            args = (shape, variant)
            jobs.append((_step_name(*args), lambda a=args: lower_step(runner, *a)))
    for s in sorted({shape.num_seqs for shape in shapes}):
        for variant in sampler.variants():
            for v in (False, True) if runner.num_speculative_tokens else (False,):
                name = f"sampler s{s} {variant}" + " verify" * v  # v: can verify proposals
                args = (s, variant, v)
                jobs.append((name, lambda a=args: lower_sample(runner, *a)))
    swap = runner.num_host_blocks > 0 if swap is None else swap
    most = min(runner.num_blocks, max_num_seqs * runner.max_blocks_per_seq)
    lower_move = runner.kv_cache.lower_block_op
    n = moves_bucket(1)
    while n <= moves_bucket(most):
        ids = np.full(n, -1, np.int32)
        for op in ("copy", "gather", "scatter") if swap else ("copy",):
            jobs.append((f"{op}_blocks {n}", lambda op=op, ids=ids: lower_move(op, ids)))
        n *= 8
    for t in sorted({shape.num_tokens for shape in shapes}):
        jobs.append((f"{SCORE} t{t}", lambda t=t: lower_score(runner, t)))
    return jobs


def program_kinds(names: list[str]) -> collections.Counter:
    """How many of the jobs ``names`` are of each kind: model decode / prefill steps, decode
    steps that sample ("sampling decode"), sampler, score, block moves, lora."""
    kinds = collections.Counter()
    for name in names:
        first, second = (name.split() + [""])[:2]
        if first == "model":
            kinds[f"model {'decode' if second == 'decode' else 'prefill'}"] += 1
        elif first == "step":
            kinds["sampling decode"] += 1
        elif first.endswith("_blocks"):
            kinds["block moves"] += 1
        else:
            kinds[first] += 1
    return kinds


def lora_jobs(runner) -> list[Job]:
    """The LoRA slot write (an engine serving adapters: changing them compiles nothing)."""
    return [] if runner.lora is None else [("lora slot write", runner.lora.lower_write)]


def _step_name(shape: StepShape, variant: Variant) -> str:
    return f"step {shape} sampler {variant}"


def lower_step(runner, shape: StepShape, variant: Variant | None = None):
    """The step program of a model shape (its logits rows all sampled), sampling ``variant``
    itself when given (a sampled decode step), else greedily."""
    empty = runner.batcher.empty(shape)
    rows = np.zeros(len(empty.logits_indices), np.int32)
    sampling = None
    if variant is not None:
        sampling = runner.sampling_input([variant.row()], len(rows))
        assert sampling.variant == variant, (sampling.variant, variant)
    packed, layout = step_program.pack_inputs(empty, rows, sampling)
    return programs.step.lower(
        runner.params,
        runner.kv_cache.pages,
        packed,  # a host array, as the steps pass it (Runner._host)
        runner.place(np.zeros(runner.fill_width, np.int32)),
        runner.statics,
        layout,
        slots_of(runner.lora),
    )


def lower_sample(runner, num_seqs: int, variant: Variant, verify: bool = False):
    """The sampler of a variant for ``num_seqs`` sequences (``verify``: the verify program)."""
    size = num_seqs * runner.batcher.logits_per_step(decode=not verify)  # its logits rows
    sampling = runner.sampling_input([variant.row()], size, constrained=True)
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


def lower_score(runner, num_tokens: int):
    """The score program of prompt logprobs in a step of ``num_tokens`` token rows."""
    hidden = np.zeros((num_tokens, runner.config.hidden_size), runner.dtype)
    size = prompt_logprobs.chunk_rows(num_tokens)
    rows = runner.place((np.zeros(size, np.int32), np.zeros(size, np.int32)))
    model = (runner.config, runner.mesh, runner.linear)
    return programs.score.lower(runner.params, runner.place(hidden), *rows, *model)


def _lower_sampler(runner, sampling: SamplingInput):
    packed, layout = step_program.pack_sampling(sampling)
    logits = _logits_like(runner, len(sampling.temperature))
    return programs.sample.lower(logits, runner.place(packed), layout, runner.fill_width)


def _logits_like(runner, num_seqs: int) -> jax.Array:
    """An array placed like the model step's logits, so the sampler compiled here is the one the
    steps call."""
    return runner.place(np.zeros((num_seqs, runner.config.vocab_size), np.float32))


__all__ = [
    "DEFAULT_SAMPLING",
    "SCORE",
    "plain_traffic",
    "program_kinds",
    "startup_jobs",
    "warmup_jobs",
]
