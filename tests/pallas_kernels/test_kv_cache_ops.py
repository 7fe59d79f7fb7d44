"""KV pool operations: exact results, padding entries skipped, and the pool updated in place."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import fresh_rng
from pagedjax.pallas_kernels import (
    copy_blocks,
    gather_blocks,
    scatter_blocks,
    write_kv,
    write_kv_reference,
)

SHAPE = (2, 9, 4, 16)  # [num_kv_heads, num_blocks, block_size, head_dim]


def random_pool(rng, dtype=jnp.float32, shape=SHAPE):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_is_exact_and_drops_negative_slots(request, dtype):
    rng = fresh_rng(request)
    num_kv_heads, num_blocks, block_size, head_dim = SHAPE
    k, v = random_pool(rng, dtype), random_pool(rng, dtype)
    k_np, v_np = np.array(k, np.float32), np.array(v, np.float32)  # copies
    slots = np.array([5, -1, 0, 35, -7, 12, num_blocks * block_size - 2], np.int32)
    k_new = random_pool(rng, dtype, (len(slots), num_kv_heads, head_dim))
    v_new = random_pool(rng, dtype, (len(slots), num_kv_heads, head_dim))

    want_k, want_v = (
        k_np.reshape(num_kv_heads, -1, head_dim),
        v_np.reshape(num_kv_heads, -1, head_dim),
    )
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[:, slot] = np.asarray(k_new[t], np.float32)
            want_v[:, slot] = np.asarray(v_new[t], np.float32)
    ref_k, ref_v = write_kv_reference(k, v, k_new, v_new, jnp.asarray(slots))
    got_k, got_v = write_kv(k, v, k_new, v_new, jnp.asarray(slots))
    for got in (got_k, ref_k):
        np.testing.assert_array_equal(np.asarray(got, np.float32), want_k.reshape(SHAPE))
    for got in (got_v, ref_v):
        np.testing.assert_array_equal(np.asarray(got, np.float32), want_v.reshape(SHAPE))
    assert k.is_deleted() and v.is_deleted(), "the pool must be donated"


def test_copy_blocks_is_exact_over_a_tree_of_pools(request):
    rng = fresh_rng(request)
    pools = {"k": [random_pool(rng), random_pool(rng)], "v": [random_pool(rng), random_pool(rng)]}
    before = jax.tree.map(np.array, pools)  # copies: the pools are donated
    src = jnp.array([3, 7, -1, 2, 4], jnp.int32)
    dst = jnp.array([5, 1, 6, -1, 3], jnp.int32)  # block 3 is read before it is overwritten
    out = copy_blocks(pools, src, dst)
    for got, old in zip(jax.tree.leaves(out), jax.tree.leaves(before), strict=True):
        want = old.copy()
        for s, d in zip(np.asarray(src), np.asarray(dst), strict=True):
            if s >= 0 and d >= 0:
                want[:, d] = old[:, s]
        np.testing.assert_array_equal(np.asarray(got), want)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(pools))


def test_gather_then_scatter_round_trips_blocks_through_host(request):
    rng = fresh_rng(request)
    pool = random_pool(rng, jnp.bfloat16)
    ids = jnp.array([4, -1, 8, 1], jnp.int32)
    blocks = gather_blocks(pool, ids)
    host = jax.device_get(blocks)  # what swap-out keeps
    np.testing.assert_array_equal(np.asarray(host[:, 1], np.float32), 0)  # padding id: zeros
    for j, b in enumerate(np.asarray(ids)):
        if b >= 0:
            np.testing.assert_array_equal(host[:, j], np.asarray(pool[:, b]))

    fresh = jnp.full(SHAPE, jnp.nan, jnp.bfloat16)
    back = scatter_blocks(fresh, ids, jnp.asarray(host))
    back = np.asarray(back, np.float32)
    for b in range(SHAPE[1]):
        if b in (4, 8, 1):
            np.testing.assert_array_equal(back[:, b], np.asarray(pool[:, b], np.float32))
        else:
            assert np.isnan(back[:, b]).all(), f"block {b} was not in block_ids"


def _param_aliases(hlo: str) -> set[int]:
    header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
    return {int(p) for p in re.findall(r"\{[\d, ]*\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}


def _full_pool_copies(hlo: str, shape) -> list[str]:
    dims = ",".join(map(str, shape))
    return [line for line in hlo.splitlines() if re.search(rf"\[{dims}\]\S* copy\(", line)]


@pytest.mark.parametrize(
    "name,fn,args,pool_params",
    [
        pytest.param(
            "write_kv",
            write_kv,
            lambda p: (p, p, jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 16)), jnp.zeros(3, jnp.int32)),
            {0, 1},
            id="write_kv",
        ),
        pytest.param(
            "copy_blocks",
            copy_blocks,
            lambda p: ((p, p), jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.int32)),
            {0, 1},
            id="copy_blocks",
        ),
        pytest.param(
            "scatter_blocks",
            scatter_blocks,
            lambda p: (p, jnp.zeros(2, jnp.int32), jnp.zeros((2, 2, 4, 16))),
            {0},
            id="scatter_blocks",
        ),
    ],
)
def test_pool_updates_alias_the_donated_pool_and_never_copy_it(name, fn, args, pool_params):
    pool = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    hlo = fn.lower(*args(pool)).compile().as_text()
    assert pool_params <= _param_aliases(hlo), f"{name}: pool parameters not aliased to outputs"
    assert not _full_pool_copies(hlo, SHAPE), f"{name} copies the whole pool"


def test_kv_cache_validation_errors():
    pool = jnp.zeros(SHAPE)
    with pytest.raises(ValueError, match="same shape"):
        copy_blocks(pool, jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="1-D integer"):
        gather_blocks(pool, jnp.zeros(2))
    with pytest.raises(ValueError, match="one per block id"):
        scatter_blocks(jnp.zeros(SHAPE), jnp.zeros(2, jnp.int32), jnp.zeros((2, 3, 4, 16)))
    with pytest.raises(ValueError, match="same num_blocks"):
        copy_blocks(
            (pool, jnp.zeros((2, 5, 4, 16))), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(pool, pool, jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 16)), jnp.zeros(2, jnp.int32))
