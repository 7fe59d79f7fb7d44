"""The TPU's KV write: each new row scattered into the pool in place, on the layout the Mosaic
kernels read.

XLA:TPU lays a scatter's operand out with its window dimensions minor. ``write_kv_reference``
scatters [num_kv_heads, head_dim] windows into the pool viewed as [num_kv_heads, slots,
head_dim]: that layout puts the heads below the slots, while the kernels read the pool row-major
([num_kv_heads, num_blocks, block_size, head_dim]), so XLA copied every layer's whole pool into
the scatter's layout and back (64 whole-pool copies per decode step of a 30-layer model on a v5e).
Here every index is explicit, one (KV head, block, offset) per row, so that the only window
dimension is head_dim, the pool's minor one: the scatter updates the row-major pool where it lies
(tests/aot/ counts the copies in the compiled programs). An 8-bit pool's scales, one float per
(KV head, block, offset), are scattered the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..kv_cache import check_write, stored_rows


def write_kv_rows(
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,
    k_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim or fewer]
    v_new: jax.Array,
    slot_mapping: jax.Array,  # i32[num_tokens], negative = drop
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, width] (8-bit pool)
    v_scales: jax.Array | None = None,
):  # (k_pages, v_pages), or (k_pages, v_pages, k_scales, v_scales) for an 8-bit pool
    """``write_kv``'s contract (pallas_kernels/kv_cache.py), one scatter index per (token, KV
    head)."""
    check_write(k_pages, v_pages, k_new, v_new, slot_mapping, k_scales, v_scales)
    num_kv_heads, _, block_size, _ = k_pages.shape
    num_tokens = slot_mapping.shape[0]
    # One index per (token, KV head), flattened: i32[num_tokens * num_kv_heads] each
    shape = (num_tokens, num_kv_heads)
    heads = jnp.broadcast_to(jnp.arange(num_kv_heads, dtype=jnp.int32), shape).reshape(-1)
    offsets = jnp.broadcast_to((slot_mapping % block_size)[:, None], shape).reshape(-1)

    def write(pool, new):  # new [num_tokens, num_kv_heads, ...]: one row, or one scale, each
        # A dropped row's block is past the array (a TPU's scales have spare rows), so
        # mode="drop" drops it (-1 would wrap).
        blocks = jnp.where(slot_mapping < 0, pool.shape[1], slot_mapping // block_size)
        blocks = jnp.broadcast_to(blocks[:, None], shape).reshape(-1)
        new = new.reshape(num_tokens * num_kv_heads, *new.shape[2:])
        return pool.at[heads, blocks, offsets].set(new, mode="drop")

    rows = stored_rows(k_pages, k_new, v_new, k_scales)
    pools = (k_pages, v_pages) + ((k_scales, v_scales) if k_scales is not None else ())
    return tuple(write(pool, new) for pool, new in zip(pools, rows, strict=True))
