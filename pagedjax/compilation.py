"""Compiled programs across processes and their cost: JAX's persistent compilation cache, and the
programs and seconds spent tracing, lowering and compiling (or loading compiled programs), per
process and per thread (a server compiles rare programs on a thread of its own while the engine
thread steps, and each counts its own).

The cache lives under ``$PAGEDJAX_CACHE_DIR/jax`` (default ``~/.cache/pagedjax/jax``), so a second
process with the same model and shapes loads its programs instead of compiling them;
``PAGEDJAX_COMPILATION_CACHE=0`` turns it off. XLA's GPU autotuning results are kept beside them
(``jax/xla_gpu_per_fusion_autotune_cache_dir``), so a second start on a GPU does not autotune
again. A ``jax_compilation_cache_dir`` set by the user is left as it is. JAX keys an entry by
the lowered program, its compile options and the devices, so a key is stable across processes
as long as the traced programs are: the jitted steps take only hashable configuration as static
arguments, never closures or ids.
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
# The XLA caches JAX keeps under its compilation cache directory when that cache is on.
XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"
_lock = threading.Lock()
_seconds = 0.0
_programs = 0
_listening = False
_thread = threading.local()  # .programs, .seconds: this thread's share


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
    jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
    return path


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    # JAX reports each event on the thread that traced, lowered or compiled.
    global _seconds, _programs
    if event not in _EVENTS:
        return
    compiled = int(event == dispatch.BACKEND_COMPILE_EVENT)
    with _lock:
        _seconds += duration_secs
        _programs += compiled
    _thread.seconds = getattr(_thread, "seconds", 0.0) + duration_secs
    _thread.programs = getattr(_thread, "programs", 0) + compiled


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling (or loading from the
    persistent cache) since ``track_compile_seconds`` first ran."""
    return _seconds


def programs_compiled() -> int:
    """Programs this process has compiled (or loaded from the persistent cache) since
    ``track_compile_seconds`` first ran."""
    return _programs


def this_thread() -> tuple[int, float]:
    """(programs compiled or loaded, seconds spent) by the calling thread so far: the difference
    of two readings is what the code between them compiled, whatever other threads did."""
    return getattr(_thread, "programs", 0), getattr(_thread, "seconds", 0.0)


def track_compile_seconds() -> None:
    """Start counting compiled programs and adding up compile time (idempotent)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
