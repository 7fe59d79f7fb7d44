"""Shared fixtures: a per-session parameter cache, one compilation cache for every session, tiny
random HF models saved locally."""

from __future__ import annotations

import os
import warnings

import pytest

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
