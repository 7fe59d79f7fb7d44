"""Running one stage: its soft budget, its hard limit, its warnings, and its result recorded
whatever happens (a failure never stops the next stage)."""

from __future__ import annotations

import contextlib
import signal
import threading
import traceback
import warnings

from .common import (
    Budget,
    BudgetSpent,
    Context,
    StageResult,
    StageSkipped,
    StageTimeout,
    say,
    write_json,
)

HARD_FACTOR, HARD_SLACK_S = 1.5, 30.0


@contextlib.contextmanager
def hard_limit(seconds: float, key: str):
    """SIGALRM after ``seconds`` raises StageTimeout in the main thread (POSIX only)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise StageTimeout(f"stage {key} stopped at its hard limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_stage(ctx: Context, key: str, title: str, fn, budget_s: float) -> StageResult:
    """Run one stage: fn(ctx, budget, data) -> (ok, summary). Records, never raises, a failure."""
    result = StageResult(key, title)
    ctx.results[key] = result
    say(f"\n== {key}: {title} (budget {budget_s:.0f} s) ==")
    budget = Budget(budget_s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with hard_limit(budget_s * HARD_FACTOR + HARD_SLACK_S, key):
                ok, result.summary = fn(ctx, budget, result.data)
            result.status = "PASS" if ok else "FAIL"
        except StageSkipped as e:
            result.status, result.summary = "SKIP", str(e)
        except BudgetSpent as e:
            result.status, result.summary = "PARTIAL", f"{e}; " + summary_of_partial(result.data)
        except (Exception, StageTimeout) as e:
            result.status = "ERROR"
            result.error = traceback.format_exc()
            result.summary = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            say(result.error)
    result.seconds = budget.seconds - budget.left()
    result.warnings = unique_warnings(caught)
    for w in result.warnings:
        say(f"warning: {w}")
    say(f"-> {result.status} in {result.seconds:.1f} s: {result.summary}")
    write_json(ctx)
    return result


def summary_of_partial(data: dict) -> str:
    return data.get("partial", "results so far in the JSON")


def unique_warnings(caught) -> list[str]:
    seen: dict[str, None] = {}
    for w in caught:
        text = f"{w.category.__name__}: {str(w.message).strip()}"
        seen.setdefault(text[:400], None)
    return list(seen)
