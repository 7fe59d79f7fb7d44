"""Shared fixtures: a per-session parameter cache, one compilation cache for every session, tiny
random HF models saved locally. The tests' helper modules live in tests/support/ (fake models,
tiny HF models, server helpers, ...), put on the path here: ``from fake_model import ...``."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore", message=".*Some donated buffers were not usable.*")


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache beside pytest's rotating per-session directories, so
    that the next session loads the programs this one compiled (counts of compiled programs are
    the same either way: a program loaded from the cache counts as one)."""
    import jax

    root = tmp_path_factory.getbasetemp().parent / "pagedjax-jax-cache"
    jax.config.update("jax_compilation_cache_dir", str(root))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture(scope="session", autouse=True)
def _param_cache(tmp_path_factory):
    """Keep converted-parameter caches inside the test session, not in the user's home."""
    old = os.environ.get("PAGEDJAX_CACHE_DIR")
    os.environ["PAGEDJAX_CACHE_DIR"] = str(tmp_path_factory.mktemp("pagedjax-cache"))
    yield
    if old is None:
        os.environ.pop("PAGEDJAX_CACHE_DIR", None)
    else:
        os.environ["PAGEDJAX_CACHE_DIR"] = old


def _memory_maps() -> tuple[int, int]:
    """(memory mappings this process holds, the most the kernel allows it); (0, 0) where
    /proc does not say."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


@pytest.fixture(scope="session", autouse=True)
def _guard_for_the_suite():
    """One process runs every test and holds the programs of all of them: the engine's guard
    (pagedjax/executables.py), which drops compiled programs past half the memory-map limit,
    would do so in the middle of tests that count what compiles. The suite keeps its own bound
    (``_bounded_executables``, between modules) and lets the guard act only near the limit."""
    from pagedjax import executables

    executables.guard().share = 0.9


@pytest.fixture(scope="module", autouse=True)
def _bounded_executables():
    """JAX keeps every program a process compiles, and each XLA:CPU executable holds about ten
    memory mappings: one process running the whole suite (``make test-all``) passes the kernel's
    vm.max_map_count (65,530 by default), and then an mmap fails inside XLA and the process dies
    of SIGSEGV. A module that starts with over half the limit in use drops JAX's caches first;
    the programs it needs come back from the persistent compilation cache."""
    used, limit = _memory_maps()
    if limit and used > limit // 2:
        import jax

        jax.clear_caches()
        gc.collect()
    yield
