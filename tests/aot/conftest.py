"""Deviceless compiles for a TPU or a GPU (pagedjax/aot/); the helpers are aot_cases.py's."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_persistent_cache():
    """Programs compiled for a target that is not here are not this machine's to cache (JAX
    could not load them back)."""
    import jax

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
