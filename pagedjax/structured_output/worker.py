"""Grammar compilation in a worker thread with a stack and a time budget of its own.

llguidance recurses in native code while it builds a grammar; on the caller's thread (8 MiB of
stack on the main thread, less on others) a deep enough grammar overflows it and the process dies.
The static bounds (structured_limits.py) keep grammars far below what ``STACK_BYTES`` holds, and
the worker's stack is the margin behind them. A compilation over ``budget_s`` is refused with a
ValueError; its thread cannot be interrupted (native code), so it runs on, holding one of the
``MAX_WORKERS`` slots until it ends: at most that many compilations run at once, and a caller
finding every slot taken waits for one up to its budget, then is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

STACK_BYTES = 256 << 20  # virtual; only the pages a compilation touches are committed
MAX_WORKERS = 4
BUDGET_S = 10.0

_slots = threading.BoundedSemaphore(MAX_WORKERS)
_running = [0]  # workers started and not yet ended (those over budget included)
_running_lock = threading.Lock()
_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set it, start, restore


def running() -> int:
    """Compilations running now, those already refused for time included."""
    with _running_lock:
        return _running[0]


def _ended() -> None:
    with _running_lock:
        _running[0] -= 1
    _slots.release()


def run_bounded(fn: Callable[[], T], what: str, budget_s: float = BUDGET_S) -> T:
    """fn() in a worker thread with a large stack: its result, or its exception re-raised
    (a RecursionError as ValueError); ValueError naming ``what`` when it runs over budget_s."""
    if not _slots.acquire(timeout=budget_s):
        raise ValueError(
            f"{what}: {MAX_WORKERS} grammar compilations are already running; retry later"
        )
    box: dict[str, object] = {}

    def work():
        try:
            box["result"] = fn()
        except RecursionError:
            box["error"] = ValueError(f"{what}: too deeply nested to compile")
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            _ended()

    thread = threading.Thread(target=work, name="grammar-compile", daemon=True)
    with _running_lock:
        _running[0] += 1
    try:
        with _stack_lock:
            previous = threading.stack_size(STACK_BYTES)
            try:
                thread.start()
            finally:
                threading.stack_size(previous)
    except BaseException:
        _ended()
        raise
    thread.join(budget_s)
    if thread.is_alive():
        raise ValueError(
            f"{what}: compiling it took more than {budget_s:g} s, the limit; simplify it"
        )
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
