"""Compiling and warm-up of one runner's programs: the program set (worker/warmup_jobs.py lists
every program a workload within the engine's limits can need; its length is the bound), the
common ones a server compiles before it answers, and compiling a list of them (worker/warmup.py),
counted as the runner's."""

from __future__ import annotations

import logging

from pagedjax import executables
from pagedjax.worker import warmup_jobs as program_set
from pagedjax.worker.input_batch import StepShape
from pagedjax.worker.sampler import Variant
from pagedjax.worker.warmup import Job, WarmupReport, compile_jobs

logger = logging.getLogger("pagedjax.worker.runner")


class RunnerCompiler:
    """``runner``'s programs (a worker/runner.py Runner): what ``warmup_jobs`` lowers reads the
    runner's weights, pool, placements and buckets; what compiles is counted by its device
    calls (``DeviceCalls.count``)."""

    def __init__(self, runner):
        self.runner = runner

    def step_shapes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
        return self.runner.batcher.step_shapes(max_num_seqs, max_num_batched_tokens)

    def warmup_jobs(
        self, max_num_seqs: int, max_num_batched_tokens: int, *, swap: bool | None = None
    ) -> list[Job]:
        """Every program a workload within these limits can need, as (name, lowering thunk);
        the async placeholders' fill is in the step program."""
        return program_set.warmup_jobs(self.runner, max_num_seqs, max_num_batched_tokens, swap)

    def startup_jobs(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        default: Variant | None = program_set.DEFAULT_SAMPLING,
    ) -> list[Job]:
        """The programs a server compiles before it answers, for requests that sample as
        ``default`` (worker/warmup_jobs.py)."""
        limits = (max_num_seqs, max_num_batched_tokens)
        return program_set.startup_jobs(self.runner, *limits, default)

    def program_bound(self, max_num_seqs: int, max_num_batched_tokens: int, swap=None) -> int:
        """The most programs the runner's steps can compile within these limits."""
        return len(self.warmup_jobs(max_num_seqs, max_num_batched_tokens, swap=swap))

    def compile(self, jobs: list[Job], **kwargs) -> WarmupReport:
        """Compile ``jobs`` (worker/warmup.py's ``compile_jobs``, which takes ``kwargs``) and
        count what they compiled as the runner's; safe on a thread beside the engine's."""
        calls = self.runner.calls
        report = compile_jobs(jobs, guard=calls.guard, **kwargs)
        calls.count(report.num_compiled, report.compile_seconds)
        calls.warmed_up = True
        return report

    def warmup(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        swap: bool | None = None,
        progress: bool = True,
    ) -> WarmupReport:
        """Compile every program a workload within these limits can need (the program set's
        bound) on a thread pool (XLA compiles outside the GIL); returns the seconds each
        program took (compiled, or loaded from the persistent cache)."""
        jobs = self.warmup_jobs(max_num_seqs, max_num_batched_tokens, swap=swap)
        logger.info("warm-up: the engine's whole program set, %d programs", len(jobs))
        executables.warn_if_unsafe(len(jobs))
        return self.compile(jobs, progress=progress)
