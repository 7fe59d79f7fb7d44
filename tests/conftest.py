"""Shared fixtures: a per-session parameter cache, tiny random HF models saved locally."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore", message=".*Some donated buffers were not usable.*")


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
