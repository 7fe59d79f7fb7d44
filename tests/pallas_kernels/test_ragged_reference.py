"""The ragged reference (the CPU attention) against the float64 numpy oracle.

Its packed rows go in tiles through one of three branches (no live row / one sequence's rows /
rows of several sequences): the batches here are laid out so that small tiles hit all three, with
empty sequences between and after the others, NaN padding rows and an all-NaN pool outside the
written slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    TOLERANCE,
    fresh_rng,
    numpy_attention,
    query_positions,
    ragged_case,
    rel_err,
)
from pagedjax.pallas_kernels import ragged_paged_attention_reference
from pagedjax.pallas_kernels.reference.ragged import EMPTY, ONE_SEQUENCE, PER_ROW

SHAPE = dict(num_heads=6, num_kv_heads=2, block_size=8, head_dim=16)
# Rows: 2 decodes, a 13-row prompt, a 6-row chunk, an empty slot, 2 new tokens after a cached
# prefix, a 9-row prompt, then 3 NaN padding rows. Tiles of 4: mixed, one-sequence, ..., empty.
SEQS = [(1, 1), (30, 1), (21, 13), (40, 6), (0, 0), (53, 2), (9, 9)]


def reference(case, *, tile_rows, max_query_len=None, window=None, soft_cap=None):
    fn = functools.partial(
        ragged_paged_attention_reference,
        scale=case.scale,
        max_query_len=max_query_len or case.max_query_len,
        soft_cap=soft_cap,
        tile_rows=tile_rows,
    )
    return jax.jit(lambda args, w: fn(*args, sliding_window=w))(case.args(), window)


def tile_branches(case, tile_rows) -> set[int]:
    """Which branches the case's tiles take (recomputed here from the layout)."""
    owner = {row: seq for row, seq, _ in query_positions(case)}
    num_tiles = -(-case.q.shape[0] // tile_rows)
    taken = set()
    for t in range(num_tiles):
        seqs = {owner[r] for r in range(t * tile_rows, (t + 1) * tile_rows) if r in owner}
        taken.add(EMPTY if not seqs else ONE_SEQUENCE if len(seqs) == 1 else PER_ROW)
    return taken


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tile_rows", [4, 16])
def test_reference_matches_numpy_on_a_mixed_batch(request, tile_rows, dtype):
    case = ragged_case(fresh_rng(request), SEQS, pad_rows=3, **SHAPE, dtype=jnp.dtype(dtype))
    if tile_rows == 4:
        assert tile_branches(case, tile_rows) == {EMPTY, ONE_SEQUENCE, PER_ROW}
    for window, soft_cap in [(None, None), (jnp.int32(5), 3.0)]:
        out = reference(case, tile_rows=tile_rows, window=window, soft_cap=soft_cap)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        expected = numpy_attention(case, window=window and int(window), soft_cap=soft_cap)
        assert rel_err(out, expected) <= TOLERANCE[dtype]
        used = int(case.query_start_loc[-1])
        assert not np.asarray(out[used:], np.float32).any(), "padding rows must come back zero"


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_numpy_on_random_batches(seed):
    """Random mixes, a bucketed max_query_len above the longest query, random tile sizes."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(int(rng.integers(3, 9))):
        kind = rng.choice(["decode", "prefill", "chunk", "empty"])
        ctx = int(rng.integers(1, 70))
        q_len = {"decode": 1, "prefill": ctx, "chunk": int(rng.integers(1, ctx + 1)), "empty": 0}
        seqs.append((ctx if kind != "empty" else 0, q_len[kind]))
    seqs.append((5, 2))  # at least one sequence with several rows
    case = ragged_case(rng, seqs, pad_rows=int(rng.integers(0, 9)), **SHAPE, dtype=jnp.float32)
    max_q = case.max_query_len + int(rng.integers(0, 5))
    out = reference(case, tile_rows=int(rng.choice([2, 3, 8])), max_query_len=max_q)
    assert rel_err(out, numpy_attention(case, window=None, soft_cap=None)) <= 2e-5


def test_rows_past_max_query_len_are_zero(request):
    case = ragged_case(
        fresh_rng(request), [(20, 12), (7, 1)], pad_rows=0, **SHAPE, dtype=jnp.float32
    )
    out = np.asarray(reference(case, tile_rows=4, max_query_len=8))
    expected = numpy_attention(case, window=None, soft_cap=None)
    assert not out[8:12].any()
    assert rel_err(np.delete(out, range(8, 12), 0), np.delete(expected, range(8, 12), 0)) <= 2e-5


@pytest.mark.slow
def test_benchmark_small_mode_runs_and_agrees_with_the_padded_layout():
    from ragged_reference_benchmark import main

    rows = main(["--small", "--repeats", "1"])
    assert len(rows) == 3
    for row in rows:
        assert row["err"] <= 2e-5 and row["old"] > 0 and row["new"] > 0
