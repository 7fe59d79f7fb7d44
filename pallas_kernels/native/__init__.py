"""Native CPU kernels: C++ sources beside this file, built on first use, called through XLA's FFI.

On a CPU, XLA's own code for the paged attention and for the layer scan's matmuls reads far more
memory than the work needs (docs/benchmarks/history-2026-12.md, a decode step's time). The kernels
here read each byte once. A kernel's source ``NAME.cc`` is compiled with the system's C++
compiler into ``$PAGEDJAX_CACHE_DIR/native`` (default ``~/.cache/pagedjax/native``) the first time
a process asks for it (or earlier: ``prebuild``, which ``LLM()`` calls before it loads the
model, starts the compilers in the background), keyed by the source and the headers beside it,
the flags, jaxlib's version and this CPU's model and flags, then loaded and its handlers
registered as FFI targets for the "cpu" platform. ``on_cpu`` calls a kernel only where the
program runs on a CPU.

Where no compiler is found or the build fails, ``load`` warns once and returns None, and callers
take their plain XLA path. ``PAGEDJAX_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

ENV_SWITCH = "PAGEDJAX_NATIVE"  # "0" / "false" / "off" / "no": never build or call them
ENV_DIR = "PAGEDJAX_CACHE_DIR"
SOURCE_DIR = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fno-math-errno")

_lock = threading.Lock()
_loaded: dict[str, Library | None] = {}
_registered: set[str] = set()  # FFI targets registered in this process (XLA keeps them for good)
_started: dict[Path, tuple] = {}  # builds ``prebuild`` started, by output, not yet finished


@dataclass(frozen=True)
class Library:
    """A built kernel source: its FFI target names, one per exported handler symbol."""

    name: str
    path: Path
    targets: dict[str, str]  # handler symbol -> registered FFI target name

    def target(self, symbol: str) -> str:
        return self.targets[symbol]


def enabled() -> bool:
    off = os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")
    return not off and jax.default_backend() == "cpu"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model name and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    root = os.environ.get(ENV_DIR) or Path.home() / ".cache" / "pagedjax"
    return Path(root) / "native"


def _key(source: bytes, cxx: str) -> str:
    import jaxlib

    h = hashlib.sha256(source)
    for header in sorted(SOURCE_DIR.glob("*.h")):  # what every source includes (common.h)
        h.update(b"\0" + header.read_bytes())
    for part in (" ".join(FLAGS), cxx, jaxlib.__version__, _cpu_identity()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _output(name: str, cxx: str) -> tuple[Path, str]:
    """Where NAME.cc's build lives in the cache, and its key."""
    key = _key((SOURCE_DIR / f"{name}.cc").read_bytes(), cxx)
    return _cache_dir() / f"{name}-{key}.so", key


def _start_compile(name: str, cxx: str, out: Path) -> tuple[subprocess.Popen, list[str], str]:
    """Start compiling NAME.cc into a file of its own (renamed into place by ``_finish``: another
    process building the same library at the same time never loads a half-written file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE_DIR / f"{name}.cc"), "-o", tmp]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, cmd, tmp


def _finish(job: tuple[subprocess.Popen, list[str], str], out: Path) -> None:
    proc, cmd, tmp = job
    try:
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_missing() -> None:
    """Compile every source beside this file that the cache lacks, all at once (those
    ``prebuild`` started are waited for): a process's first kernel would otherwise wait for one
    build, and the next kernel for another (each about 5 s on 2 cores). A failure here is left
    for that kernel's own ``load`` to report."""
    for job, out in _start_missing():
        with contextlib.suppress(OSError, RuntimeError):
            _finish(job, out)


def _start_missing() -> list[tuple[tuple, Path]]:
    """The build of each source the cache lacks, started (or the one ``prebuild`` started)."""
    cxx = compiler()
    if cxx is None:
        return []
    jobs = []
    for source in sorted(SOURCE_DIR.glob("*.cc")):
        out, _ = _output(source.stem, cxx)
        job = _started.pop(out, None)
        if job is None and not out.exists():
            job = _start_compile(source.stem, cxx, out)
        if job is not None:
            jobs.append((job, out))
    return jobs


def prebuild() -> None:
    """Start building, in the background, the sources the cache lacks, so that they compile
    while the caller does other work (the model's load): the first ``load`` then waits only for
    what is left. Nothing when native kernels are off or already loaded in this process."""
    if not enabled():
        return
    with _lock:
        if _loaded or _started:
            return
        with contextlib.suppress(OSError):
            _started.update((out, job) for job, out in _start_missing())


@atexit.register
def _drop_started() -> None:
    """A build started but never waited for (the process ends first): stopped, its temporary
    file removed."""
    for proc, _, tmp in _started.values():
        with contextlib.suppress(OSError):
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _started.clear()


def _build(name: str, symbols: tuple[str, ...]) -> Library:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out, key = _output(name, cxx)
    if not out.exists():
        _finish(_start_compile(name, cxx, out), out)
    lib = ctypes.cdll.LoadLibrary(str(out))
    targets = {}
    for symbol in symbols:
        # The source's hash is in the target name, so a program compiled against an older build
        # (and kept in JAX's persistent cache) is never run with a newer one.
        target = f"pagedjax_{symbol}_{key}"
        if target not in _registered:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), "cpu")
            _registered.add(target)
        targets[symbol] = target
    return Library(name, out, targets)


def load(name: str, symbols: tuple[str, ...]) -> Library | None:
    """Build (once per machine), load and register ``NAME.cc``'s handlers ``symbols``; None when
    native kernels are off, not on a CPU backend, or the build failed (warned once)."""
    if not enabled():
        return None
    with _lock:
        if not _loaded:  # the process's first kernel: every missing build at once
            _build_missing()
        if name not in _loaded:
            try:
                _loaded[name] = _build(name, symbols)
            except (OSError, RuntimeError, AttributeError) as err:
                warnings.warn(
                    f"native CPU kernel {name!r} unavailable, using XLA's path: {err}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _loaded[name] = None
        return _loaded[name]


def on_cpu(native_fn, xla_fn, *args, **kwargs):
    """``native_fn(*args, **kwargs)`` where the program runs on a CPU, ``xla_fn`` elsewhere, so a
    program lowered for a GPU/TPU never holds the CPU custom call. Array keyword arguments
    become operands; the others (scale, soft cap, a Python int window) stay static.

    The choice is made at lowering, per platform, by a primitive of its own (``_on_cpu_p``):
    tracing records one equation, typed by the native call, and only the branch for the
    platform being lowered is ever traced. (``lax.platform_dependent`` traces both branches in
    every trace, which doubled a model step's tracing time on a CPU.)"""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    flat, in_tree = jax.tree.flatten((args, arrays))
    branches = _Branches(native_fn, xla_fn, tuple(sorted(static.items())), in_tree)
    out_shapes = jax.eval_shape(functools.partial(native_fn, **static), *args, **arrays)
    out_flat, out_tree = jax.tree.flatten(out_shapes)
    outs = _on_cpu_p().bind(
        *flat,
        branches=branches,
        out_avals=tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out_flat),
    )
    return jax.tree.unflatten(out_tree, outs)


@dataclass(frozen=True, eq=False)
class _Branches:
    """The two functions of an ``on_cpu`` call with its static keyword arguments, and how to
    rebuild its (args, array kwargs) from flat operands."""

    native_fn: object
    xla_fn: object
    static: tuple
    in_tree: object

    def flat(self, fn):
        """``fn`` over flat operands, returning its outputs flat."""

        def run(*flat):
            args, arrays = jax.tree.unflatten(self.in_tree, flat)
            return jax.tree.leaves(fn(*args, **arrays, **dict(self.static)))

        return run


def _abstract_eval(*avals, branches, out_avals):
    return out_avals


def _batch(batched, dims, *, branches, out_avals):
    """vmap: both branches mapped over the operands' batch axes (moved to the front)."""
    moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(batched, dims, strict=True)]
    axes = tuple(None if d is None else 0 for d in dims)

    def mapped(fn):
        def run(*flat):
            return tuple(jax.vmap(branches.flat(fn), in_axes=axes)(*flat))

        return run

    outs = on_cpu(mapped(branches.native_fn), mapped(branches.xla_fn), *moved)
    return list(outs), [0] * len(outs)


@functools.cache
def _on_cpu_p():
    """The primitive, made and registered on first use: only where a native kernel is called (a
    GPU or TPU process never touches JAX's primitive internals here)."""
    from jax._src import dispatch
    from jax.extend import core as jex_core
    from jax.interpreters import batching, mlir

    def lowering(which: str):
        def rule(ctx, *operands, branches, out_avals):
            fn = branches.flat(getattr(branches, which))
            return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)

        return rule

    p = jex_core.Primitive("pagedjax_on_cpu")
    p.multiple_results = True
    p.def_impl(functools.partial(dispatch.apply_primitive, p))
    p.def_abstract_eval(_abstract_eval)
    mlir.register_lowering(p, lowering("native_fn"), platform="cpu")
    mlir.register_lowering(p, lowering("xla_fn"))
    batching.primitive_batchers[p] = _batch
    return p
