"""``x @ w[layer]`` for a stacked kernel ``w`` [num_layers, in, out], without copying the slice;
and ``x @ w.T`` (a tied embedding as the LM head).

Inside the layer scan, XLA's CPU backend copies ``w[layer]`` into a fresh buffer before the dot
(a dynamic slice is never an alias of its operand there). At the few rows of a decode step the dot
is bound by reading the kernel, so the copy (one more write and one more read of every weight)
makes the step 2-3x the time of one read of the parameters. On a CPU, ``layer_matmul`` runs a
native kernel (native/matmul_cpu.cc) that reads the layer's rows in place; elsewhere, or where
native kernels are unavailable, it is the plain ``jnp.dot`` of the slice
(``layer_matmul_reference``), and the slice is copied there too: on an H200, XLA:GPU compiled a
scan over stacked bf16 kernels with a ``dynamic-slice`` fusion producing each layer's whole
``bf16[1,14336,4096]`` before its GEMM (0.39-0.40 of the memory floor). Off a CPU the layers run
unrolled over one array per layer instead (models/layer_loop.py: 0.99-1.15 of it there).

``matmul_transposed`` is ``x @ w.T`` for ``w`` [N, K] (the embedding table as a tied LM head):
on a CPU a native kernel that streams ``w``'s rows once, as dot products for a few rows of x
(XLA's CPU dot reads that layout at about half the memory bandwidth), and for more rows through
panels of w transposed on the fly and multiplied as the layer kernels multiply w. Where the
layers' kernels are packed (``pack_stacked``), the table is too (``pack_table``): the head is then
``packed_matmul_transposed`` (the packed layer kernel, no transposes) and the embedding lookup
``packed_take``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import native
from .row_major_table import RowMajorTable

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SYMBOLS = ("LayerMatmul", "LayerMatmulPacked", "MatmulTransposed")  # native/matmul_cpu.cc's
PACK_WIDTH = 32  # columns per tile of a packed stack (pack_stacked)


def layer_matmul_reference(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
    """``x`` [M, K] @ ``w[layer]`` [K, N] -> [M, N] in x's dtype (f32 accumulation)."""
    dims = (((1,), (0,)), ((), ()))
    y = jax.lax.dot_general(x, w[layer].astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def native_supported(x: jax.Array, w: jax.Array) -> bool:
    """Whether the native kernels take these operands' dtypes (float32 / bfloat16)."""
    return jnp.dtype(x.dtype) in _DTYPES and jnp.dtype(w.dtype) in _DTYPES


def layer_matmul(
    x: jax.Array, w: jax.Array, layer: jax.Array, live_rows: jax.Array | None = None
) -> jax.Array:
    """``x`` [M, K] @ ``w[layer]`` ([num_layers, K, N] stacked) -> [M, N], x's dtype.

    ``layer`` is an int32 scalar (traced: the scan's layer index), clamped to the stack. On a CPU
    the native kernel reads the layer's kernel in place; on other platforms, or without a native
    build, the slice and a dot. ``live_rows`` (int32 scalar, default M): only x's first
    ``live_rows`` rows are needed (a step's real tokens); the native kernel computes those and
    returns zeros below them (XLA's path computes every row: the rows wanted agree either way)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"layer_matmul needs x [M, K] and w [L, K, N], got {x.shape} and {w.shape}"
        )
    return _native_layer_matmul(
        "LayerMatmul", layer_matmul_reference, x, w, w.shape[2], layer, live_rows
    )


def _native_layer_matmul(symbol, reference, x, w, n, layer, live_rows):
    """The native handler ``symbol`` for x [M, K] and a stack w (n output columns) on a CPU,
    ``reference(x, w, layer)`` elsewhere or without a native build."""
    lib = native.load("matmul_cpu", SYMBOLS) if native_supported(x, w) else None
    if lib is None:
        return reference(x, w, layer)
    call = jax.ffi.ffi_call(lib.target(symbol), jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows, jnp.int32).reshape(())
    elsewhere = lambda x, w, layer, live: reference(x, w, layer)  # noqa: E731
    return native.on_cpu(call, elsewhere, x, w, layer, live)


def pack_stacked(w: jax.Array) -> jax.Array:
    """A stacked kernel [L, K, N] packed tile-major, [L, N / 32, K, 32]: tile t holds columns
    [32 t, 32 t + 32) of every row, so that each tile the native kernel computes is one
    contiguous run of weights, which a CPU streams from DRAM (row-major, a tile's rows lie N
    apart, each on a page of its own: 11-21% slower at 64 rows, benchmarks/weight_layout_cpu.cc).
    N must be a multiple of 32."""
    L, K, N = w.shape
    if N % PACK_WIDTH:
        raise ValueError(f"pack_stacked needs N a multiple of {PACK_WIDTH}, got {w.shape}")
    return jnp.transpose(w.reshape(L, K, N // PACK_WIDTH, PACK_WIDTH), (0, 2, 1, 3))


def unpack_stacked(p: jax.Array) -> jax.Array:
    """``pack_stacked``'s inverse: [L, N / 32, K, 32] -> [L, K, N]."""
    L, T, K, W = p.shape
    return jnp.transpose(p, (0, 2, 1, 3)).reshape(L, K, T * W)


def packed_layer_matmul_reference(x: jax.Array, p: jax.Array, layer: jax.Array) -> jax.Array:
    """``x`` [M, K] @ layer ``layer`` of a packed stack ``p`` [L, N / 32, K, 32] -> [M, N]."""
    return layer_matmul_reference(x, unpack_stacked(p[layer][None]), 0)


def packed_layer_matmul(
    x: jax.Array, p: jax.Array, layer: jax.Array, live_rows: jax.Array | None = None
) -> jax.Array:
    """``layer_matmul`` over a stack packed by ``pack_stacked`` ([L, N / 32, K, 32]): the same
    products, summed in the same order (bit for bit the row-major kernel's), with each tile's
    weights read as one run."""
    if x.ndim != 2 or p.ndim != 4 or p.shape[3] != PACK_WIDTH or x.shape[1] != p.shape[2]:
        raise ValueError(
            f"packed_layer_matmul needs x [M, K] and w [L, N / {PACK_WIDTH}, K, {PACK_WIDTH}], "
            f"got {x.shape} and {p.shape}"
        )
    n = p.shape[1] * PACK_WIDTH
    return _native_layer_matmul(
        "LayerMatmulPacked", packed_layer_matmul_reference, x, p, n, layer, live_rows
    )


def pack_table(w: jax.Array) -> jax.Array:
    """A table ``w`` [N, K] (a tied embedding) packed as ``pack_stacked`` packs ``w.T``, one
    layer dropped: [N / 32, K, 32], tile t holding rows [32 t, 32 t + 32) of w, transposed. The
    tied LM head ``x @ w.T`` then runs the packed layer kernel (``packed_matmul_transposed``),
    and a token's row is ``packed_take``. N must be a multiple of 32."""
    if w.ndim != 2 or w.shape[0] % PACK_WIDTH:
        raise ValueError(f"pack_table needs N a multiple of {PACK_WIDTH}, got {w.shape}")
    return pack_stacked(w.T[None])[0]


def unpack_table(p: jax.Array) -> jax.Array:
    """``pack_table``'s inverse: [N / 32, K, 32] -> [N, K]."""
    return unpack_stacked(p[None])[0].T


def packed_take(p: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` of a table packed by ``pack_table`` ([N / 32, K, 32]) -> [len(ids), K]: row
    i is ``p[i // 32, :, i % 32]`` (an embedding lookup; ids must lie in [0, N))."""
    ids = jnp.asarray(ids, jnp.int32)
    return p[ids // PACK_WIDTH, :, ids % PACK_WIDTH]


def packed_matmul_transposed(x: jax.Array, p: jax.Array) -> jax.Array:
    """``x`` [M, K] @ ``w.T`` for a table ``w`` [N, K] packed by ``pack_table`` -> [M, N], x's
    dtype: the packed layer kernel over a stack of one (the same products as
    ``packed_layer_matmul``, at any row count: each row's bits do not depend on how many rows
    there are). SmolLM2's tied head on a 2-core CPU (benchmarks/layer_matmul_cpu.py): 19% less
    time than ``matmul_transposed`` at 64 rows, 42% less at 8, within 4% of XLA's dot at 256."""
    if x.ndim != 2 or p.ndim != 3 or p.shape[2] != PACK_WIDTH or x.shape[1] != p.shape[1]:
        raise ValueError(
            f"packed_matmul_transposed needs x [M, K] and a packed table [N / {PACK_WIDTH}, K, "
            f"{PACK_WIDTH}], got {x.shape} and {p.shape}"
        )
    return packed_layer_matmul(x, p[None], jnp.int32(0))


def matmul_transposed_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x`` [M, K] @ ``w``.T ([N, K]) -> [M, N] in x's dtype (f32 accumulation)."""
    dims = (((1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# x's rows up to which matmul_transposed is native. SmolLM2's tied head on a 2-core CPU
# (benchmarks/layer_matmul_cpu.py, time XLA / native): 1.07 at 96 rows, 1.04 at 128, 0.94 at 192,
# 0.88-0.90 at 256 and 512.
TRANSPOSED_NATIVE_MAX_ROWS = 128


def matmul_transposed(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x`` [M, K] @ ``w``.T ([N, K]) -> [M, N], x's dtype: native on a CPU up to
    ``TRANSPOSED_NATIVE_MAX_ROWS`` rows of x (SmolLM2's tied head, 2-core CPU: 1.04-1.2x XLA's
    dot from 8 to 128 rows, within 10% at 1), else XLA's dot."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"matmul_transposed needs x [M, K] and w [N, K], got {x.shape} and {w.shape}"
        )
    native_rows = x.shape[0] <= TRANSPOSED_NATIVE_MAX_ROWS
    lib = native.load("matmul_cpu", SYMBOLS) if native_rows and native_supported(x, w) else None
    if lib is None:
        return matmul_transposed_reference(x, w)
    call = jax.ffi.ffi_call(
        lib.target("MatmulTransposed"), jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype)
    )
    return native.on_cpu(call, matmul_transposed_reference, x, w)


# ---- the CPU's linear methods (chosen at load; models/linear.py says what a method is) --------

_DOT = (((1,), (0,)), ((), ()))


def _plain(x: jax.Array, kernel: jax.Array, layer) -> jax.Array:
    """x @ kernel (or kernel[layer] of a stack) by XLA's dot, in x's dtype."""
    kernel = kernel if layer is None else kernel[layer]
    return jax.lax.dot_general(x, kernel.astype(x.dtype), _DOT)


def _float_stack(weights: dict) -> bool:
    k = weights["kernel"]
    return set(weights) == {"kernel"} and k.ndim == 3 and jnp.dtype(k.dtype) in _DTYPES


@dataclasses.dataclass(frozen=True)
class InPlaceLinear:
    """A stacked float kernel [L, in, out] multiplied where it lies (``layer_matmul``: the
    native kernel on a CPU, where XLA would copy the slice before its dot)."""

    def kernel_shape(self, n_in: int, n_out: int, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, n_in, n_out)

    def accepts(self, weights: dict) -> bool:
        return _float_stack(weights)

    def process_weights_after_loading(self, weights: dict) -> dict:
        return weights

    def apply(self, x, weights: dict, layer=None, live_rows=None) -> jax.Array:
        kernel = weights["kernel"]
        if layer is None or x.ndim != 2:
            return _plain(x, kernel, layer)
        return layer_matmul(x, kernel.astype(x.dtype), layer, live_rows)


@dataclasses.dataclass(frozen=True)
class PackedLinear:
    """A stacked float kernel held packed tile-major, [L, out / 32, in, 32] (``pack_stacked``),
    which the native CPU kernel streams (``packed_layer_matmul``): the row-major kernel's bits."""

    def kernel_shape(self, n_in: int, n_out: int, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, n_out // PACK_WIDTH, n_in, PACK_WIDTH)

    def accepts(self, weights: dict) -> bool:
        k = weights["kernel"]
        packed = set(weights) == {"kernel"} and k.ndim == 4 and k.shape[3] == PACK_WIDTH
        return packed or (_float_stack(weights) and k.shape[2] % PACK_WIDTH == 0)

    def process_weights_after_loading(self, weights: dict) -> dict:
        if weights["kernel"].ndim == 4:  # packed already (parameters another runner processed)
            return weights
        return {**weights, "kernel": _pack_stacked(weights["kernel"])}

    def apply(self, x, weights: dict, layer=None, live_rows=None) -> jax.Array:
        return packed_layer_matmul(x, weights["kernel"], layer, live_rows)


@dataclasses.dataclass(frozen=True)
class NativeTable(RowMajorTable):
    """An embedding table [N, K] as it is; the tied head ``x @ table.T`` by
    ``matmul_transposed`` (native on a CPU up to its row limit)."""

    def attend(self, x: jax.Array, table: jax.Array) -> jax.Array:
        return matmul_transposed(x, table)


@dataclasses.dataclass(frozen=True)
class PackedTable:
    """A tied table packed as the layers' kernels ([N / 32, K, 32], ``pack_table``): the head
    runs the packed layer kernel (``packed_matmul_transposed``), the lookup ``packed_take``."""

    def table_shape(self, n: int, k: int) -> tuple[int, ...]:
        return (n // PACK_WIDTH, k, PACK_WIDTH)

    def accepts(self, table: jax.Array) -> bool:
        float_table = jnp.dtype(table.dtype) in _DTYPES
        if table.ndim == 3:
            return float_table and table.shape[2] == PACK_WIDTH
        return float_table and table.ndim == 2 and table.shape[0] % PACK_WIDTH == 0

    def process_weights_after_loading(self, table: jax.Array) -> jax.Array:
        return table if table.ndim == 3 else _pack_table(table)

    def lookup(self, table: jax.Array, ids: jax.Array) -> jax.Array:
        return packed_take(table, ids)

    def attend(self, x: jax.Array, table: jax.Array) -> jax.Array:
        return packed_matmul_transposed(x, table)


_pack_stacked = jax.jit(pack_stacked)
_pack_table = jax.jit(pack_table)


@dataclasses.dataclass(frozen=True)
class CpuLinearMethods:
    """The CPU's choice of linear methods for a model's layers under the scan (the caller
    passes its layers' stacked projection weights, and a tied table or None). Packed
    (``PackedLinear``, 11-21% faster at a decode step's 64 rows) when every projection can be:
    float kernels whose widths are multiples of 32; then a tied table of a multiple of 32 rows
    is packed with them (``PackedTable``). Else stacked float kernels read in place
    (``InPlaceLinear``) and the table as it is (``NativeTable``). None for the layers (the
    caller's own methods) where they are quantized or the native kernels are unavailable (not
    a CPU, switched off, no compiler)."""

    def choose(self, projections: list[dict], table: jax.Array | None):
        """-> (the layers' method or None, the table's method or None)."""
        if native.load("matmul_cpu", SYMBOLS) is None:
            return None, None
        if projections and all(PackedLinear().accepts(w) for w in projections):
            tied = table is not None and PackedTable().accepts(table)
            return PackedLinear(), PackedTable() if tied else NativeTable()
        if projections and all(InPlaceLinear().accepts(w) for w in projections):
            return InPlaceLinear(), NativeTable()
        return None, NativeTable()
