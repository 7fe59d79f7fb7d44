"""The native backend, the engine's on a CPU: the C++ kernels of ``native.py`` where they are
built, else XLA's paths (``chunked.py`` for decode over a long table, the reference otherwise).

``native.on_cpu`` makes the choice per platform at lowering, so a program using this backend but
lowered for a GPU or TPU holds XLA's path, never the CPU custom call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from .. import native as native_build
from ..backend import AttentionBackend
from ..reference import reference_decode, reference_prefill
from . import native
from .chunked import SINGLE_PASS_TOKENS, chunked_decode

__all__ = ["NativeBackend", "chunked_decode"]


def _window_as_array(opts):
    """A Python int window as an i32 scalar: every leaf that ``on_cpu`` takes is an array."""
    w = opts.sliding_window
    return opts if w is None else opts.replace(sliding_window=jnp.asarray(w, jnp.int32))


@dataclasses.dataclass(frozen=True)
class NativeBackend(AttentionBackend):
    name = "native"
    follows_rows = True
    follows_context = True
    num_threads: int | None = None  # at most this many threads; None: XLA's intra-op pool
    tile_rows: int = native.TILE_ROWS  # query rows per ragged task

    def __post_init__(self):
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be None or >= 1, got {self.num_threads}")
        if self.tile_rows < 1:
            raise ValueError(f"tile_rows must be >= 1, got {self.tile_rows}")

    @property
    def reads_rows_only(self) -> bool:
        return native.available()

    def _serves(self, q, kv) -> bool:
        return native.available() and native.supports(q.dtype, kv.k_pages.dtype)

    def decode(self, q, kv, md, opts):
        # XLA's path: one pass over a short table (its gather stays in cache), chunks up to the
        # longest real context over a long one.
        single_pass = md.block_tables.shape[1] * kv.block_size <= SINGLE_PASS_TOKENS
        xla = reference_decode if single_pass else chunked_decode
        if not self._serves(q, kv):
            return xla(q, kv, md, opts)
        kernel = functools.partial(native.native_decode, num_threads=self.num_threads)
        return native_build.on_cpu(kernel, xla, q, kv, md, _window_as_array(opts))

    def prefill(self, q, kv, md, opts):
        if not self._serves(q, kv):
            return reference_prefill(q, kv, md, opts)
        kernel = functools.partial(
            native.native_prefill, tile_rows=self.tile_rows, num_threads=self.num_threads
        )
        return native_build.on_cpu(kernel, reference_prefill, q, kv, md, _window_as_array(opts))
