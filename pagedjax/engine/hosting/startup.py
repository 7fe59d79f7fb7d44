"""A server's start: the serving engine launched, the programs compiled before it answers, the
rest in the background, and what that cost.

``start_engine(options)`` is the one way a serving engine starts (``pagedjax serve`` in-thread,
the engine process, Ray Serve replicas): the engine of the options' EngineArgs, its programs
compiled (``prepare``), its in-thread host (engine_loop.EngineLoop) with the start attached, the
periodic stats line; in a follower process of a multi-process run, the follower's part instead.
``prepare(engine)`` compiles the bucket policy's common programs (the runner's
``startup_jobs``, worker/warmup.py) and returns a ``Startup`` that holds the rest. The engine
loop calls ``ready()`` once the engine thread runs, just before the server answers ``/health``:
it logs the seconds since the process started and starts the background compile. The counts are
exported as Prometheus gauges (``Startup`` is a collector the engine loop registers).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import re
import time

from prometheus_client.core import GaugeMetricFamily

from pagedjax import executables
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.request import row_fields
from pagedjax.engine.stats_log import start_stats_log
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker.sampler import SamplingInput, SamplingRow, Variant, plain_greedy
from pagedjax.worker.warmup import BackgroundCompile, Job, WarmupReport
from pagedjax.worker.warmup_jobs import DEFAULT_SAMPLING, SCORE, plain_traffic

logger = logging.getLogger("pagedjax.api_server")

_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since this module was
    imported, which is later)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def freeze_startup_objects() -> None:
    """Move every object alive now (the model's host-side state, the tokenizer, jax's caches:
    millions of them) to the collector's permanent generation, as vLLM does after start-up. A
    full collection then walks only what serving allocates: on a 2-core machine a full collection
    of an unfrozen server took 0.3-0.57 s, a pause for every stream, and frozen 0.06-0.1 s."""
    gc.collect()
    gc.freeze()


def freeze_compiled_objects() -> None:
    """After the background compile: freeze what compiling made too (jax's caches and
    executables, alive for as long as the server). Left in the collected heap, they made every
    full collection of the engine process walk them: 110-130 ms pauses of the engine's steps on
    a 2-core machine. No collection first (it would pause the steps once more); a few cycles of
    garbage that compiling left, if any, stay."""
    gc.freeze()


class Startup:
    """Programs compiled before the server answered (``report``) and those left to compile in
    the background (``background``; None: they compile on first use)."""

    def __init__(
        self,
        report: WarmupReport,
        background: BackgroundCompile | None = None,
        bound: int | None = None,
    ):
        self.report = report
        self.background = background
        self.bound = bound  # the engine's program set (None: not listed, no warm-up)
        self.seconds_to_ready: float | None = None  # process start -> the server answers

    def ready(self) -> None:
        """The server is about to answer: log how long that took, freeze what start-up made,
        start the background."""
        self.seconds_to_ready = process_age()
        freeze_startup_objects()
        pending = self.background.num_jobs if self.background is not None else 0
        logger.info(
            "serving %.1f s after the process started: %d programs compiled at start in %.1f s; "
            "%d more %s",
            self.seconds_to_ready,
            self.report.num_compiled,
            self.report.seconds,
            pending,
            "compile in the background" if self.background is not None else "compile on first use",
        )
        if self.background is not None:
            self.background.start()

    def stop(self) -> None:
        if self.background is not None:
            self.background.stop()

    def collect(self):
        """Prometheus: the start's figures (a collector's ``collect``)."""
        bg = self.background
        figures = (
            (
                "startup_seconds",
                "Seconds from the process's start until the server answered.",
                self.seconds_to_ready or 0.0,
            ),
            (
                "startup_programs",
                "Programs compiled (or loaded from the cache) before the server answered.",
                self.report.num_compiled,
            ),
            (
                "background_compiled_programs",
                "Programs compiled (or loaded) by the background compile since.",
                bg.num_compiled if bg is not None else 0,
            ),
            (
                "background_compile_pending",
                "Programs the background compile has yet to go through.",
                bg.num_jobs - bg.num_done if bg is not None else 0,
            ),
        )
        guard = executables.guard()
        maps, limit = executables.memory_maps()
        figures += (
            ("program_bound", "The most programs the engine can compile.", self.bound or 0),
            ("memory_maps", "Memory mappings the process holds.", maps),
            ("memory_map_limit", "The kernel's limit on them (vm.max_map_count).", limit),
            (
                "executable_evictions",
                "Times every compiled program was dropped near the memory-map limit.",
                guard.num_evictions,
            ),
        )
        for name, help_, value in figures:
            yield GaugeMetricFamily(f"pagedjax_{name}", help_, value=value)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How a serving engine starts: its arguments (an EngineArgs: LLM's keywords), how many
    requests may wait (the server's ``max_queue``), which programs compile before it answers
    (``prepare``'s ``warmup``, ``warmup_all``, ``background_compile``), and an engine process's
    log level. Pickled to an engine process."""

    engine_args: object
    max_queue: int
    warmup: bool = True
    warmup_all: bool = False
    background_compile: bool = True
    log_level: str = "info"


def start_engine(options: EngineOptions, after_pass=None) -> EngineLoop | None:
    """The serving engine of ``options``: loaded, its programs compiled as the options say, on
    its in-thread host (``after_pass``: EngineLoop's) with the start attached (the background
    compile begins with the loop), the periodic stats line logged unless
    ``disable_log_stats``. None in a follower process of a multi-process run, once it has
    replayed the driver's steps to the end (process 0 alone serves)."""
    engine = LLMEngine.from_engine_args(options.engine_args)
    compiles = (options.warmup, options.warmup_all, options.background_compile)
    start = prepare(engine, *compiles)
    if not engine.is_driver:
        engine.follow()
        engine.close()
        return None
    loop = EngineLoop(engine, options.max_queue, after_pass=after_pass)
    loop.attach_startup(start)
    if not options.engine_args.disable_log_stats:
        start_stats_log(lambda: loop.metrics.engine_stats)
    return loop


def prepare(
    engine: LLMEngine, warmup: bool = True, warmup_all: bool = False, background: bool = True
) -> Startup:
    """Compile what the server needs before it answers: nothing (``warmup=False``: everything
    compiles on first use), every program (``warmup_all``), or the bucket policy's common ones
    (the runner's ``startup_jobs``; a draft model's runner lists all) with the rest left to a
    background compile (``background``) or to first use."""
    if not warmup:
        return Startup(WarmupReport([], 0.0))
    runner = engine.runner
    sched = engine.config.scheduler
    limits = (sched.max_num_seqs, sched.token_budget)
    swap = engine.block_manager.num_host_blocks > 0
    if warmup_all:
        return Startup(runner.warmup(*limits, swap=swap))
    default = default_variant(engine)
    every = runner.warmup_jobs(*limits, swap=swap)
    logger.info("the engine's program set: at most %d programs", len(every))
    executables.warn_if_unsafe(len(every))
    first = runner.startup_jobs(*limits, default=default)
    report = runner.compile(first, progress=True)
    if not background or not engine.is_driver:  # a follower compiles on the driver's first use
        return Startup(report, bound=len(every))
    done = {name for name, _ in first}
    rest = _rarest_last(every, done, default)
    nearest = NearTraffic(runner.shapes_built, default)
    background = BackgroundCompile(
        runner.compile, rest, freeze_compiled_objects, prefer=nearest, guard=executables.guard()
    )
    return Startup(report, background, bound=len(every))


def default_variant(engine) -> Variant | None:
    """The sampler variant of a request that sets nothing: temperature 1 alone, unless the
    model's generation config sets defaults (``engine.default_sampling_params``); None when
    such a request is plain greedy (no sampler at all)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(**engine.default_sampling_params)
    row = SamplingRow(**row_fields(params, vocab))
    return None if plain_greedy([row]) else SamplingInput.build([row], 1, vocab).variant


def _rarest_last(
    jobs: list[Job], done: set[str], default: Variant | None = DEFAULT_SAMPLING
) -> list[Job]:
    """The jobs not compiled yet: first the programs plain requests run (``plain_traffic``:
    model steps, default sampling), then the rarer ones (penalties, masks, logprobs, block
    moves), then the score programs (prompt logprobs). Within each, those of fewer
    sequences (s), narrower tables (b) and fewer tokens (t) first, as their names say (``model
    decode t16 s16 b64``): more requests meet them. Ties keep their order; a name without these
    sizes (block copies) goes first."""
    rest = [job for job in jobs if job[0] not in done]
    sizes = [dict(_SIZE.findall(name)) for name, _ in rest]
    smallest: dict[str, int] = {}
    for found in sizes:
        for key, value in found.items():
            smallest[key] = min(smallest.get(key, int(value)), int(value))

    def rank(i: int) -> float:
        return sum(math.log2(int(v) / smallest[k]) for k, v in sizes[i].items())

    def key(i: int) -> tuple[int, float]:
        name = rest[i][0]
        rarest = name.startswith(SCORE)
        return 2 if rarest else 0 if plain_traffic(name, default) else 1, rank(i)

    return [rest[i] for i in sorted(range(len(rest)), key=key)]


_SIZE = re.compile(r"\b([sbt])(\d+)\b")


class NearTraffic:
    """The background compile's choice of its next program (``BackgroundCompile.prefer``): of
    those plain requests run (``plain_traffic``), one at most ``MAX_STEPS`` buckets above a shape
    the steps have used (``shapes``, the runner's ``InputBatcher.shapes_built``): a batch grows
    by more sequences, tokens or context, and meets these next. Nearest first; None when no
    program is that near (the queue's order then)."""

    MAX_STEPS = 2  # buckets up, summed over sequences, tokens and table width

    def __init__(self, shapes: list, default: Variant | None = DEFAULT_SAMPLING):
        self.shapes = shapes  # appended on the engine thread; read here as a copy
        self.default = default  # the sampler variant of a request that sets nothing
        self._sizes: dict[str, tuple[bool | None, dict[str, int]] | None] = {}

    def __call__(self, jobs: list[Job]) -> int | None:
        used = [
            (s.max_query_len == 1, {"t": s.num_tokens, "s": s.num_seqs, "b": s.max_blocks})
            for s in list(self.shapes)
        ]
        best: tuple[float, int] | None = None
        for i, (name, _) in enumerate(jobs):
            job = self._job_sizes(name)
            if job is None:
                continue
            steps = min((_steps_up(u, job) for u in used), default=math.inf)
            if steps <= self.MAX_STEPS and (best is None or steps < best[0]):
                best = (steps, i)
        return None if best is None else best[1]

    def _job_sizes(self, name: str) -> tuple[bool | None, dict[str, int]] | None:
        if name not in self._sizes:
            sizes = {k: int(v) for k, v in _SIZE.findall(name)}
            # A step's kind (decode or not); a sampler's (sizes: s alone) serves either.
            kind = "decode" in name.split() if "t" in sizes else None
            plain = plain_traffic(name, self.default) and "s" in sizes
            self._sizes[name] = (kind, sizes) if plain else None
        return self._sizes[name]


def _steps_up(used: tuple[bool, dict[str, int]], job: tuple[bool | None, dict[str, int]]) -> float:
    """Buckets (powers of two) from a used shape up to a job's, summed over the job's sizes; inf
    if the kinds differ (decode or not) or a size is smaller. A decode step's tokens are its
    sequences: counted once."""
    (decode, u), (kind, j) = used, job
    if kind is not None and kind != decode:
        return math.inf
    keys = [k for k in j if not (k == "t" and decode)]
    if any(j[k] < u[k] for k in keys):
        return math.inf
    return sum(math.log2(j[k] / u[k]) for k in keys)
