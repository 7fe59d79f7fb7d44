"""KV pool operations: write new K/V by slot mapping, copy blocks, gather/scatter for swapping.

Pool layout (per layer): ``[num_kv_heads, num_blocks, block_size, head_dim]``. A slot is
``block * block_size + offset``; a negative slot means "drop this row" (padding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _check_pages(k_pages: jax.Array, v_pages: jax.Array) -> None:
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_blocks, block_size, head_dim], got {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ in shape")


def write_kv_reference(
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    k_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[num_tokens], negative = drop
) -> tuple[jax.Array, jax.Array]:
    num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
    num_slots = num_blocks * block_size
    # Negative slots go out of range so that mode="drop" really drops them (-1 would wrap).
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def write(pages, new):
        flat = pages.reshape(num_kv_heads, num_slots, head_dim)
        flat = flat.at[:, slots].set(new.swapaxes(0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return write(k_pages, k_new), write(v_pages, v_new)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter ``k_new``/``v_new`` rows into the pool at ``slot_mapping``; the pool is donated."""
    _check_pages(k_pages, v_pages)
    if k_new.shape != v_new.shape or k_new.ndim != 3:
        raise ValueError(
            f"k_new/v_new must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {k_new.shape} and {v_new.shape}"
        )
    if k_new.shape[1:] != (k_pages.shape[0], k_pages.shape[3]):
        raise ValueError(
            f"k_new rows {k_new.shape[1:]} do not match the pool's "
            f"(num_kv_heads, head_dim) = {(k_pages.shape[0], k_pages.shape[3])}"
        )
    if slot_mapping.shape != (k_new.shape[0],):
        raise ValueError(
            f"slot_mapping shape {slot_mapping.shape} must be ({k_new.shape[0]},), one per token"
        )
    return write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping)
