"""Which programs compile before a server answers, and compiling a list of them.

The bucket policy (``common_shapes``): before ``/health`` answers, only the model programs that
most requests of a fresh server meet: decode steps of up to ``COMMON_SEQS`` sequences whose
contexts fit ``COMMON_CONTEXT`` tokens, and a single fresh prompt of up to ``COMMON_PROMPT``
tokens (the smallest sequence bucket, the table width its own blocks need). With the default
limits that is 11 model programs out of several hundred (12 where the kernels bucket the longest
query). Everything rarer (more sequences, longer contexts and prompts, penalties, grammars,
logprobs, speculation, block copies and swaps) compiles in the background after the server
answers (``BackgroundCompile``), and a request that needs a program before then compiles it on
first use on the engine thread, as it would without any warm-up.

Compiling = tracing and lowering (which hold the GIL: one at a time), then XLA's compile (outside
the GIL: on a thread pool). Both are thread-safe in JAX, so the background thread compiles while
the engine thread steps; running a step stays the engine thread's alone. Counts are per thread
(``compilation.this_thread``), so programs compiled in the background are not counted again by
a step that runs meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from tqdm.auto import tqdm

from pagedjax import compilation
from pagedjax.executables import ExecutableGuard
from pagedjax.utils import cdiv

logger = logging.getLogger(__name__)

COMMON_SEQS = 32  # decode steps of up to this many sequences compile before serving
COMMON_CONTEXT = 512  # ... whose block tables cover at most this many tokens
COMMON_PROMPT = 512  # one fresh prompt of up to this many tokens compiles before serving

Job = tuple[str, Callable[[], object]]  # (program name, thunk returning its jax Lowered)


@dataclasses.dataclass
class WarmupReport:
    programs: list[tuple[str, float]]  # (program, seconds to compile or load it)
    seconds: float  # wall time of the warm-up
    num_compiled: int = 0  # programs compiled or loaded (a program compiled before: none)
    compile_seconds: float = 0.0  # tracing, lowering and compiling them


def common_shapes(batcher, shapes) -> list:
    """The model-step shapes (of ``shapes``, a runner's ``step_shapes``) compiled before a server
    answers: decode steps of up to ``COMMON_SEQS`` sequences with contexts within
    ``COMMON_CONTEXT`` tokens, and the steps of a single fresh prompt of up to ``COMMON_PROMPT``
    tokens. ``batcher``: the runner's InputBatcher (its buckets)."""
    bs = batcher.block_size
    smallest_seqs = min(s.num_seqs for s in shapes)
    context_blocks = batcher.blocks_bucket(
        min(cdiv(COMMON_CONTEXT, bs), batcher.max_blocks_per_seq)
    )
    token_buckets = sorted({s.num_tokens for s in shapes if s.max_query_len > 1})
    single_prompt = set()  # (tokens, blocks, query) of one fresh prompt of length n
    for lo, t in zip([0, *token_buckets], token_buckets, strict=False):
        for n in range(max(lo + 1, 2), t + 1):
            if n > COMMON_PROMPT or n >= batcher.max_model_len:
                break
            blocks = batcher.blocks_bucket(cdiv(n, bs))
            single_prompt.add((t, blocks, batcher.max_query_bucket(n, t)))
    common = []
    for s in shapes:
        if s.max_query_len == 1:
            keep = s.num_seqs <= max(COMMON_SEQS, smallest_seqs) and s.max_blocks <= context_blocks
        else:
            key = (s.num_tokens, s.max_blocks, s.max_query_len)
            keep = s.num_seqs == smallest_seqs and key in single_prompt
        if keep:
            common.append(s)
    return common


def compile_jobs(
    jobs: list[Job],
    *,
    workers: int | None = None,
    progress: bool = False,
    stop: threading.Event | None = None,
    skip_failures: bool = False,
    guard: ExecutableGuard | None = None,
    background: bool = False,
) -> WarmupReport:
    """Lower each job (one at a time: tracing holds the GIL) and compile it on ``workers``
    threads (default: one per CPU; one: on the calling thread, job after job).
    ``skip_failures``: a job that fails is logged and skipped (its program then compiles on
    first use) instead of raising. ``stop``: once set, no further job starts. ``guard``
    (pagedjax/executables.py): checked after each job, so that compiled programs stay within
    the memory-map limit however many the jobs are; or, ``background`` (a thread beside the
    one that steps, which checks it), held while each job compiles."""
    held = guard.compiling if guard is not None and background else contextlib.nullcontext()
    check = guard is not None and not background
    start = time.perf_counter()
    report = WarmupReport([], 0.0)
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))

    def compile_one(name, lowered):
        before = compilation.this_thread()
        t0 = time.perf_counter()
        lowered.compile()
        after = compilation.this_thread()
        return name, time.perf_counter() - t0, after[0] - before[0], after[1] - before[1]

    with (
        tqdm(total=len(jobs), desc="compiling", disable=not progress, unit="prog") as bar,
        concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else _Inline() as pool,
    ):
        pending = []
        for name, lower in jobs:
            if stop is not None and stop.is_set():
                break
            before, t0 = compilation.this_thread(), time.perf_counter()
            with held:
                try:
                    lowered = lower()
                except Exception:
                    if not skip_failures:
                        raise
                    logger.exception("could not lower %s; it compiles on first use", name)
                    continue
                after = compilation.this_thread()
                report.num_compiled += after[0] - before[0]
                report.compile_seconds += after[1] - before[1]
                future = pool.submit(compile_one, name, lowered)
                future.lower_s = time.perf_counter() - t0
                pending.append(future)
                if workers == 1:  # one program at a time (the background), stoppable between
                    _collect([future], report, bar, skip_failures)
                    pending.clear()
            if check and workers == 1:
                guard.check()
        _collect(pending, report, bar, skip_failures)
        if check:
            guard.check()
    report.seconds = time.perf_counter() - start
    return report


class _Inline(contextlib.AbstractContextManager):
    """An executor that runs each job as it is submitted, on the calling thread."""

    def __exit__(self, *exc) -> None:
        return None

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future


def _collect(futures, report: WarmupReport, bar, skip_failures: bool) -> None:
    for future in concurrent.futures.as_completed(futures):
        try:
            name, secs, programs, seconds = future.result()
        except Exception:
            if not skip_failures:
                raise
            logger.exception("a program failed to compile; it compiles on first use")
            continue
        secs += future.lower_s
        report.programs.append((name, secs))
        report.num_compiled += programs
        report.compile_seconds += seconds
        logger.debug("compiled %s in %.2f s", name, secs)
        bar.set_postfix_str(f"{name}: {secs:.2f} s", refresh=False)
        bar.update(1)


class BackgroundCompile:
    """Compiles ``jobs`` one at a time on a thread of its own, at a lower CPU priority than the
    engine thread where the OS allows it; ``compile`` is the runner's (it counts what compiled).
    ``prefer(jobs)``, if given, picks the next job among those left (its index; None: the first
    left), so that what the traffic needs next can jump the queue. ``num_done`` / ``num_jobs``
    say how far it is; ``jobs`` are those left."""

    def __init__(
        self,
        compile: Callable[..., WarmupReport],
        jobs: list[Job],
        on_finished: Callable[[], None] | None = None,
        prefer: Callable[[list[Job]], int | None] | None = None,
        guard: ExecutableGuard | None = None,
    ):
        self._compile = compile
        self.on_finished = on_finished  # called on its thread once every job has gone through
        self.prefer = prefer
        self.guard = guard  # past its share of the memory-map limit, no further job starts
        self.jobs = list(jobs)
        self.num_jobs = len(self.jobs)
        self.num_done = 0
        self.num_compiled = 0
        self.seconds = 0.0  # wall time, once finished
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedjax-compile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 60.0) -> None:
        """No further program starts; waits up to ``timeout`` for the one compiling."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _next(self) -> int:
        if self.prefer is None:
            return 0
        try:
            i = self.prefer(self.jobs)
        except Exception:  # the queue's own order then
            logger.exception("choosing the next program to compile failed; compiling in order")
            self.prefer = None
            return 0
        return 0 if i is None else i

    def _run(self) -> None:
        lower_priority()
        start = time.perf_counter()
        try:
            while self.jobs and not self._stop.is_set():
                if self.guard is not None and self.guard.over_share():
                    logger.warning(
                        "background compile stopped with %d programs left: the process's "
                        "memory mappings passed %d%% of vm.max_map_count; they compile on "
                        "first use",
                        len(self.jobs),
                        round(100 * self.guard.share),
                    )
                    break
                name, lower = self.jobs.pop(self._next())
                job = [(name, lower)]
                options = dict(progress=False, stop=self._stop, skip_failures=True)
                report = self._compile(job, workers=1, background=True, **options)
                self.num_done += 1
                self.num_compiled += report.num_compiled
            if not self._stop.is_set():
                logger.info(
                    "background compile done: %d programs compiled in %.1f s",
                    self.num_compiled,
                    time.perf_counter() - start,
                )
                if self.on_finished is not None:
                    self.on_finished()
        finally:
            self.seconds = time.perf_counter() - start
            self.finished.set()


def lower_priority() -> None:
    """Nice the calling thread (Linux: a thread id is a process id to setpriority)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
