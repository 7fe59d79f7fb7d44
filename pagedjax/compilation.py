"""Compiled programs across processes and their cost: JAX's persistent compilation cache, and the
seconds this process has spent tracing, lowering and compiling (or loading compiled programs).

The cache lives under ``$PAGEDJAX_CACHE_DIR/jax`` (default ``~/.cache/pagedjax/jax``), so a second
process with the same model and shapes loads its programs instead of compiling them;
``PAGEDJAX_COMPILATION_CACHE=0`` turns it off. A ``jax_compilation_cache_dir`` set by the user
is left as it is. JAX keys an entry by the lowered program, its compile options and the
devices, so a key is stable across processes as long as the traced programs are: the jitted
steps take only hashable configuration as static arguments, never closures or ids.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax
from jax._src import dispatch

ENV_DIR = "PAGEDJAX_CACHE_DIR"
ENV_SWITCH = "PAGEDJAX_COMPILATION_CACHE"  # "0" / "false" / "off" turns the cache off

# Trace, lowering to StableHLO, and XLA compilation (a persistent-cache hit is timed in this one).
_EVENTS = frozenset(
    {
        dispatch.JAXPR_TRACE_EVENT,
        dispatch.JAXPR_TO_MLIR_MODULE_EVENT,
        dispatch.BACKEND_COMPILE_EVENT,
    }
)
_lock = threading.Lock()
_seconds = 0.0
_listening = False


def cache_dir() -> Path | None:
    """Where compiled programs are kept, or None when the cache is off."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    root = os.environ.get(ENV_DIR) or Path.home() / ".cache" / "pagedjax"
    return Path(root) / "jax"


def enable_persistent_cache() -> Path | None:
    """Point JAX's persistent compilation cache at ``cache_dir()`` (every program, however fast
    it compiles); returns the directory in use, or None when off. Call before compiling."""
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    path = cache_dir()
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _seconds
    if event in _EVENTS:
        with _lock:
            _seconds += duration_secs


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling (or loading from the
    persistent cache) since ``track_compile_seconds`` first ran."""
    return _seconds


def track_compile_seconds() -> None:
    """Start adding up compile time (idempotent)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
