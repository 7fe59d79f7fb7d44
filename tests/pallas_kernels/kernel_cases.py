"""Random paged-attention inputs for the kernel tests and the benchmark's small mode.

Every slot of the pool starts as NaN (stale data after a swap-in or on a fresh pool); only the
slots below each sequence's length get finite values. Block tables are a random permutation of
blocks 1.. (block 0 is the null block, padding), with at least one padding column.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from pagedjax.pallas_kernels import paged_attention, ragged_paged_attention

TOLERANCE = {"float32": 1e-5, "bfloat16": 1.5e-2}  # max |out - ref| / max |ref|
HEADS = {1: (2, 2), 4: (8, 2), 5: (5, 1), 8: (16, 2)}  # GQA ratio -> (num_heads, num_kv_heads)
BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16")
PAGES_PER_BLOCK = 2  # the tests' key step: 2 pages; a partition is 2 steps


def partition_tokens(block_size: int) -> int:
    return 2 * PAGES_PER_BLOCK * block_size


# (block_size, head_dim, gqa_ratio, dtype) run by default: every value of each axis at least once.
COVER = [
    (8, 64, 4, "float32"),
    (16, 128, 5, "bfloat16"),
    (32, 64, 1, "bfloat16"),
    (16, 128, 8, "float32"),
]


def matrix():
    """Pytest params: the covering subset, then the rest of the full grid marked slow."""
    full = itertools.product(BLOCK_SIZES, HEAD_DIMS, sorted(HEADS), DTYPES)
    params = [pytest.param(*c, id=case_id(*c)) for c in COVER]
    params += [
        pytest.param(*c, id=case_id(*c), marks=pytest.mark.slow) for c in full if c not in COVER
    ]
    return params


def case_id(block_size, head_dim, ratio, dtype) -> str:
    return f"bs{block_size}-d{head_dim}-gqa{ratio}-{dtype}"


def fresh_rng(request) -> np.random.Generator:
    """New random inputs for every case (seeded by the test id, so a failure reproduces)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def tpu_interpret(**params):
    """TPU interpret mode on CPU (megacore needs num_cores_or_threads=2 or it hangs)."""
    return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(**params))


def on_backend(backend: str):
    """(context, kwargs) that run a public entry point's kernel for ``backend`` on CPU."""
    if backend == "tpu":
        return tpu_interpret(), {"backend": "tpu"}
    return contextlib.nullcontext(), {"backend": "gpu", "interpret": True}


@dataclasses.dataclass
class PagedCase:
    q: jnp.ndarray  # [num_seqs or num_tokens, num_heads, head_dim]
    k_pages: jnp.ndarray  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jnp.ndarray
    block_tables: jnp.ndarray  # i32[num_seqs, max_blocks]
    context_lens: jnp.ndarray  # i32[num_seqs]
    query_start_loc: jnp.ndarray | None = None  # i32[num_seqs + 1] (ragged cases)
    max_query_len: int | None = None

    @property
    def scale(self) -> float:
        return float(self.q.shape[-1]) ** -0.5

    def args(self):
        base = (self.q, self.k_pages, self.v_pages, self.block_tables, self.context_lens)
        return base if self.query_start_loc is None else (*base, self.query_start_loc)

    def as_float32(self) -> PagedCase:
        f32 = lambda x: x.astype(jnp.float32)
        return dataclasses.replace(
            self, q=f32(self.q), k_pages=f32(self.k_pages), v_pages=f32(self.v_pages)
        )


def _pool(rng, lens, *, num_kv_heads, block_size, head_dim, dtype, spare_blocks=2):
    lens = np.asarray(lens, np.int64)
    pages = -(-lens // block_size)  # blocks each sequence needs (0 for an empty one)
    num_blocks = 1 + int(pages.sum()) + spare_blocks
    ids = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((len(lens), int(pages.max(initial=0)) + 1), np.int32)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    used = 0
    for s, length in enumerate(lens):
        for b in range(pages[s]):
            blk = ids[used]
            used += 1
            table[s, b] = blk
            n = min(block_size, length - b * block_size)
            k[:, blk, :n] = rng.standard_normal((num_kv_heads, n, head_dim))
            v[:, blk, :n] = rng.standard_normal((num_kv_heads, n, head_dim))
    return (
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(table),
        jnp.asarray(lens, jnp.int32),
    )


def decode_case(rng, lens, *, num_heads, num_kv_heads, block_size, head_dim, dtype):
    k, v, table, lens = _pool(
        rng, lens, num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim, dtype=dtype
    )
    q = rng.standard_normal((len(lens), num_heads, head_dim))
    return PagedCase(jnp.asarray(q, dtype), k, v, table, lens)


def ragged_case(rng, seqs, *, pad_rows, num_heads, num_kv_heads, block_size, head_dim, dtype):
    """seqs: (context_len, query_len) per sequence; the queries are each sequence's last tokens.

    ``pad_rows`` padding rows follow the last sequence's; they hold NaN and must come back zero.
    """
    lens = [c for c, _ in seqs]
    q_lens = np.array([n for _, n in seqs], np.int32)
    k, v, table, lens = _pool(
        rng, lens, num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim, dtype=dtype
    )
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]) + pad_rows, num_heads, head_dim))
    q[qsl[-1] :] = np.nan
    return PagedCase(
        jnp.asarray(q, dtype),
        k,
        v,
        table,
        lens,
        query_start_loc=jnp.asarray(qsl),
        max_query_len=max(1, int(q_lens.max())),
    )


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref|, in float32; NaN anywhere in ``out`` gives inf."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    if not np.isfinite(out).all():
        return float("inf")
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1e-30)
    return float(np.max(np.abs(out - ref), initial=0.0)) / scale


def assert_matches(case, out, ref, *, kernel, dtype, record_error) -> float:
    """``out`` has the case's query shape and dtype and is within the dtype's tolerance of
    ``ref``; the error is recorded under (kernel, dtype) and returned."""
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    err = rel_err(out, ref)
    record_error(kernel, dtype, err)
    assert err <= TOLERANCE[dtype], f"{kernel} {dtype}: rel err {err:.3e} > {TOLERANCE[dtype]}"
    return err


def query_positions(case) -> list[tuple[int, int, int]]:
    """(packed row, sequence, position) of every query of the case."""
    lens = np.asarray(case.context_lens)
    if case.query_start_loc is None:
        return [(s, s, int(n) - 1) for s, n in enumerate(lens) if n > 0]
    qsl = np.asarray(case.query_start_loc)
    out = []
    for s, n in enumerate(lens):
        q_len = int(qsl[s + 1] - qsl[s])
        out += [(int(qsl[s]) + j, s, int(n) - q_len + j) for j in range(q_len)]
    return out


def first_key(pos: int, window: int | None) -> int:
    return max(pos - window + 1, 0) if window is not None and window > 0 else 0


def numpy_attention(case, *, window, soft_cap) -> np.ndarray:
    """Float64 oracle reading only the slots each query sees; rows of no query are zero."""
    q = np.asarray(case.q, np.float64)
    k_pages = np.asarray(case.k_pages, np.float64)
    v_pages = np.asarray(case.v_pages, np.float64)
    table = np.asarray(case.block_tables)
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for row, seq, pos in query_positions(case):
        t = np.arange(first_key(pos, window), pos + 1)
        blocks, offsets = table[seq, t // block_size], t % block_size
        for h in range(q.shape[1]):
            k = k_pages[h // group, blocks, offsets]  # [keys, head_dim]
            v = v_pages[h // group, blocks, offsets]
            s = case.scale * (k @ q[row, h])
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            out[row, h] = (p / p.sum()) @ v
    return out


def device_lowering_case(layout: str, platform: str, pages_dtype) -> tuple:
    """Production-like shapes (16 sequences, 515-block tables, a cap) for lowering a kernel for
    ``platform`` on this CPU: (op, abstract args, keyword args); the caller adds the window."""
    num_seqs, num_blocks, block_size, max_blocks = 16, 1027, 16, 515
    num_tokens = 1 if layout == "decode" else 1021
    sds = jax.ShapeDtypeStruct
    pages = sds((4, num_blocks, block_size, 128), pages_dtype)
    args = [
        sds((num_seqs if layout == "decode" else num_tokens, 16, 128), jnp.bfloat16),
        pages,
        pages,
        sds((num_seqs, max_blocks), jnp.int32),
        sds((num_seqs,), jnp.int32),
    ]
    kw = dict(scale=0.1, soft_cap=50.0, backend="gpu" if platform == "cuda" else "tpu")
    if layout == "decode":
        return paged_attention, args, kw
    args.append(sds((num_seqs + 1,), jnp.int32))
    return ragged_paged_attention, args, {**kw, "max_query_len": 512}
