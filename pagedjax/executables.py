"""The compiled programs a process holds, against the kernel's limit on memory mappings.

Every XLA:CPU executable keeps its machine code in memory mappings of its own (about 100 for a
SmolLM2 step program: three per kernel object), and Linux kills a process's next ``mmap`` past
``vm.max_map_count`` (65,530 by default): LLVM then fails inside XLA and the process dies. The
engine's program set is bounded (worker/warmup_jobs.py), and ``ExecutableGuard`` makes that bound
safe whatever the limit: after programs were compiled (or loaded), the engine thread checks the
process's mappings between steps, and past ``SAFE_SHARE`` of the limit it drops every compiled
program JAX holds (``jax.clear_caches``). The programs the traffic still uses come back from the
persistent compilation cache on their next use (a fraction of a second each, instead of a
compile). ``warn_if_unsafe`` says at start when the bound alone would pass that share.

XLA:CPU's own flags do not change the count (measured on SmolLM2's decode step: 96 mappings per
program by default, the same with ``--xla_cpu_parallel_codegen_split_count`` 1 or 4 and with the
thunk runtime off, 135 with the fusion emitters off), so the bound and the guard are the remedy.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time

import jax

from pagedjax import compilation

logger = logging.getLogger(__name__)

SAFE_SHARE = 0.5  # of vm.max_map_count: the guard drops compiled programs past it
MAPS_PER_PROGRAM = 110  # about what an XLA:CPU step program of a small model holds
CHECK_INTERVAL_S = 1.0  # the mappings are read at most this often (and only after compiles)


def memory_maps() -> tuple[int, int]:
    """(memory mappings this process holds, the most the kernel allows it); (0, 0) where /proc
    does not say (not Linux)."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return 0, 0


def warn_if_unsafe(program_bound: int, share: float = SAFE_SHARE) -> bool:
    """Warn (naming vm.max_map_count) when ``program_bound`` programs would hold more than
    ``share`` of the process's memory-map limit on a CPU; whether it warned."""
    if jax.default_backend() != "cpu":
        return False
    used, limit = memory_maps()
    needed = program_bound * MAPS_PER_PROGRAM
    if not limit or used + needed <= share * limit:
        return False
    logger.warning(
        "the engine's %d programs may hold about %d memory mappings, beyond %d%% of "
        "vm.max_map_count (%d; %d in use now): compiled programs will be dropped and reloaded "
        "from the compilation cache as the limit nears. Raise the limit (sysctl -w "
        "vm.max_map_count=262144) or lower max_num_seqs, max_num_batched_tokens or max_model_len",
        program_bound,
        needed,
        round(100 * share),
        limit,
        used,
    )
    return True


class ExecutableGuard:
    """Keeps the process's memory mappings below ``share`` of the kernel's limit by dropping
    JAX's compiled programs. ``check`` runs on the thread that dispatches the steps, between
    them; a thread that compiles beside it holds ``compiling`` around each program, so that
    none is dropped while it compiles."""

    def __init__(self, share: float = SAFE_SHARE):
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1), got {share}")
        self.share = share
        self.compiling = threading.RLock()
        self.num_evictions = 0  # times every compiled program was dropped
        self.peak_maps = 0  # the most mappings a check has seen
        self._seen = compilation.programs_compiled()
        self._next_check = 0.0

    def over_share(self) -> bool:
        """Whether the process's mappings are past the share of the limit now."""
        used, limit = memory_maps()
        self.peak_maps = max(self.peak_maps, used)
        return bool(limit) and used > self.share * limit

    def check(self, force: bool = False) -> bool:
        """If programs were compiled since the last look (or ``force``) and the mappings passed
        the share, drop every compiled program; whether it did. Cheap otherwise: one counter."""
        compiled = compilation.programs_compiled()
        now = time.monotonic()
        if not force and (compiled == self._seen or now < self._next_check):
            return False
        self._seen, self._next_check = compiled, now + CHECK_INTERVAL_S
        used, limit = memory_maps()
        self.peak_maps = max(self.peak_maps, used)
        if not limit or used <= self.share * limit:
            return False
        with self.compiling:
            jax.clear_caches()
            collect_all()
        after, _ = memory_maps()
        self.num_evictions += 1
        logger.warning(
            "%d memory mappings of vm.max_map_count's %d: dropped every compiled program (%d "
            "mappings left); those in use reload from the compilation cache",
            used,
            limit,
            after,
        )
        return True


def collect_all() -> None:
    """A full collection that also reaches what start-up froze (``gc.freeze``): the programs
    JAX dropped may sit in cycles there. Frozen again after, as start-up left it."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        with contextlib.suppress(Exception):
            gc.freeze()


_guard: ExecutableGuard | None = None
_guard_lock = threading.Lock()


def guard() -> ExecutableGuard:
    """The process's guard (JAX's caches are the process's: one guard for every engine)."""
    global _guard
    with _guard_lock:
        if _guard is None:
            _guard = ExecutableGuard()
        return _guard
