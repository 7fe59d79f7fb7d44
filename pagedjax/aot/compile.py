"""Compile the engine's programs for a target machine that is not here, and report on each.

The programs are the warm-up's (worker/warmup_jobs.py), lowered through a ``TargetRunner``, so
what compiles is what the engine would run: "largest" takes the model steps of the largest
decode and prefill shapes (the memory bound), "startup" what a server compiles before it answers,
"all" every program the warm-up compiles. Each is compiled by the target's own compiler (XLA:TPU
and Mosaic, or XLA:GPU, Triton and ptxas) and reported: compiled or the compiler's error, its
memory per device against the device's, and what its optimized HLO holds that a step must not
(hlo_report.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import time

import jax

from pagedjax.worker import warmup_jobs
from pagedjax.worker.warmup import Job

from .hlo_report import HloFindings, Memory, cost, scan_hlo
from .target_runner import TargetRunner
from .targets import GIB

PROGRAM_SETS = ("largest", "startup", "all")
# XLA's GPU autotuner times candidate kernels on a device; with none, take its defaults.
GPU_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    name: str
    seconds: float  # to lower and compile it here
    error: str | None = None  # the compiler's (or the lowering's) error
    memory: Memory | None = None
    findings: HloFindings | None = None
    cost: dict = dataclasses.field(default_factory=dict)

    def failures(self, device_bytes: int) -> list[str]:
        """Why this program would not do on the target (empty: it would)."""
        if self.error is not None:
            return ["does not compile"]
        out = []
        if self.memory.peak > device_bytes:
            out.append(f"needs {self.memory.peak / GIB:.2f} GiB of {device_bytes / GIB:.2f}")
        f = self.findings
        for count, what in (
            (f.pool_copies, "whole-pool copies"),
            (f.weight_copies, "weight copies"),
            (f.conditionals, "conditionals"),
        ):
            if count:
                out.append(f"{count} {what}")
        return out

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "memory": dataclasses.asdict(self.memory) if self.memory else None,
            "peak_bytes": self.memory.peak if self.memory else None,
            "findings": dataclasses.asdict(self.findings) if self.findings else None,
            "cost": self.cost,
        }


def select_jobs(runner: TargetRunner, programs: str, max_num_seqs: int, max_tokens: int, only=None):
    """The warm-up's jobs of the set ``programs`` (PROGRAM_SETS), those whose name matches the
    regular expression ``only`` if given."""
    if programs not in PROGRAM_SETS:
        raise ValueError(f"programs must be one of {PROGRAM_SETS}, got {programs!r}")
    if programs == "startup":
        jobs = warmup_jobs.startup_jobs(runner, max_num_seqs, max_tokens)
    else:
        jobs = warmup_jobs.warmup_jobs(runner, max_num_seqs, max_tokens)
    if programs == "largest":
        wanted = {
            f"model {s}" for s in largest_shapes(runner.step_shapes(max_num_seqs, max_tokens))
        }
        jobs = [job for job in jobs if job[0] in wanted]
        if len(jobs) != len(wanted):
            raise ValueError(f"the warm-up names no program {sorted(wanted)}")
    if only is not None:
        pattern = re.compile(only)
        jobs = [job for job in jobs if pattern.search(job[0])]
    return jobs


def largest_shapes(shapes) -> list:
    """The largest decode shape and the largest prefill shape (most tokens, then the widest
    table and the longest query): the steps that hold the most at once."""
    key = lambda s: (s.num_tokens, s.max_blocks, s.max_query_len, s.num_seqs)  # noqa: E731
    decode = [s for s in shapes if s.max_query_len == 1]
    prefill = [s for s in shapes if s.max_query_len > 1]
    return [max(group, key=key) for group in (decode, prefill) if group]


def compile_jobs(runner: TargetRunner, jobs: list[Job], workers: int | None = None, log=None):
    """Each job lowered (one at a time: tracing holds the GIL) and compiled on ``workers``
    threads (XLA compiles outside it; default: the CPUs, at most 4), reported in order; a
    failure is reported, not raised. ``log(report)`` is called as each finishes."""
    workers = workers or min(4, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = []
        for name, lower in jobs:
            start = time.perf_counter()
            try:
                with jax.set_mesh(runner.lowering_mesh):  # Pallas reads the target's chip off it
                    lowered = lower()
            except Exception as e:  # a lowering error is the report
                futures.append(pool.submit(_failed, name, start, e))
                continue
            futures.append(pool.submit(_compile, runner, name, lowered, start))
        reports = []
        for future in futures:
            reports.append(future.result())
            if log is not None:
                log(reports[-1])
    return reports


def _failed(name: str, start: float, error: Exception) -> ProgramReport:
    return ProgramReport(name, time.perf_counter() - start, error=_first_lines(error))


def _compile(runner: TargetRunner, name: str, lowered, start: float) -> ProgramReport:
    options = GPU_COMPILER_OPTIONS if runner.target.platform == "cuda" else None
    try:
        compiled = lowered.compile(options)
        text = compiled.as_text()
    except Exception as e:  # the compiler's error is the report
        return _failed(name, start, e)
    findings = scan_hlo(text, runner.pool_leaf_shapes(), runner.weight_shapes())
    return ProgramReport(
        name,
        time.perf_counter() - start,
        memory=Memory.of(compiled),
        findings=findings,
        cost=cost(compiled),
    )


def _first_lines(error: Exception, lines: int = 6) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return "\n".join(text[:lines])


def format_table(reports: list[ProgramReport], device_bytes: int) -> str:
    """One line per program: memory in GiB per device, the HLO's findings, the verdict."""
    head = (
        f"{'program':<44} {'args':>6} {'donated':>7} {'temp':>6} {'peak':>6} {'pool cp':>7} "
        f"{'wt cp':>5} {'cond':>4} {'while':>5} {'GB moved':>8}  verdict"
    )
    rows = [head]
    for r in reports:
        if r.error is not None:
            first = r.error.splitlines()[0][:120]
            rows.append(f"{r.name[:44]:<44} compile error: {first}")
            continue
        m, f = r.memory, r.findings
        moved = r.cost.get("bytes accessed")
        moved = f"{moved / 1e9:8.2f}" if moved is not None else f"{'-':>8}"
        verdict = "; ".join(r.failures(device_bytes)) or "ok"
        rows.append(
            f"{r.name[:44]:<44} {m.arguments / GIB:6.2f} {m.donated / GIB:7.2f} "
            f"{m.temporaries / GIB:6.2f} {m.peak / GIB:6.2f} {f.pool_copies:7d} "
            f"{f.weight_copies:5d} {f.conditionals:4d} {f.while_loops:5d} {moved}  {verdict}"
        )
    return "\n".join(rows)
