"""KV pool operations: write new K/V by slot mapping, copy blocks, gather/scatter for swapping.

Pool layout (per layer): ``[num_kv_heads, num_blocks, block_size, head_dim]``. A slot is
``block * block_size + offset``; a negative slot or block id means "skip this entry" (padding).
An 8-bit pool (int8 or float8_e4m3fn pages) adds f32 scales ``[num_kv_heads, num_blocks,
block_size]``, one per token and KV head; the block operations move them as leaves of the tree.
A TPU pool is stored padded to whole 128-lane rows (pool_layout.py): pages of a larger head_dim
than the rows written (the new rows are padded with zeros) and scale rows wider than block_size.

These are scatters and gathers that XLA already emits in place, so they stay plain XLA (no Pallas
kernel): what matters is that the pool is donated, so a step never copies the whole pool (the
tests check the compiled programs' input/output aliasing). The block operations take one pool
array or any pytree of them (e.g. every layer's K and V), so one call serves the whole cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._common import check_kv_scales


def _check_pages(k_pages: jax.Array, v_pages: jax.Array) -> None:
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_blocks, block_size, head_dim], got {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ in shape")


def quantize_kv(
    x: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    dtype,  # int8 or float8_e4m3fn
) -> tuple[jax.Array, jax.Array]:  # (x in dtype, same shape; f32[num_tokens, num_kv_heads])
    """Symmetric per-(token, head) quantization: int8 ``round(x / s)`` with ``s = max|x| / 127``,
    fp8 ``x / s`` with ``s = max|x| / 448``. A zero row gets scale 1 (and zeros)."""
    dtype = jnp.dtype(dtype)
    qmax = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)  # 448 for e4m3fn
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [num_tokens, num_kv_heads]
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    y = jnp.clip(x / scale[..., None], -qmax, qmax)  # e4m3fn has no inf: never overflow to NaN
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def write_kv_reference(
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    k_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[num_tokens], negative = drop
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size] (8-bit pool)
    v_scales: jax.Array | None = None,
):  # (k_pages, v_pages), or (k_pages, v_pages, k_scales, v_scales) for an 8-bit pool
    num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
    num_slots = num_blocks * block_size
    # Negative slots go out of range so that mode="drop" really drops them (-1 would wrap).
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def write(pages, new):  # new [num_tokens, num_kv_heads, head_dim]
        flat = pages.reshape(num_kv_heads, num_slots, head_dim)
        flat = flat.at[:, slots].set(new.swapaxes(0, 1), mode="drop")
        return flat.reshape(pages.shape)

    def write_scales(scales, new):  # new f32[num_tokens, num_kv_heads]
        blocks = jnp.where(slot_mapping < 0, scales.shape[1], slot_mapping // block_size)
        return scales.at[:, blocks, slot_mapping % block_size].set(new.T, mode="drop")

    rows = stored_rows(k_pages, k_new, v_new, k_scales)
    if k_scales is None:
        return write(k_pages, rows[0]), write(v_pages, rows[1])
    k_q, v_q, k_s, v_s = rows
    return (
        write(k_pages, k_q),
        write(v_pages, v_q),
        write_scales(k_scales, k_s),
        write_scales(v_scales, v_s),
    )


def stored_rows(pages, k_new, v_new, scales=None) -> tuple:
    """The new rows as the pool stores them: in its dtype, padded with zeros to its head_dim;
    for an 8-bit pool (``scales`` given) quantized, with their scales f32[num_tokens,
    num_kv_heads]: (k, v) or (k, v, k_scales, v_scales)."""
    pad = pages.shape[3] - k_new.shape[2]

    def stored(x):
        x = x.astype(pages.dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad))) if pad else x

    if scales is None:
        return stored(k_new), stored(v_new)
    k_q, k_s = quantize_kv(k_new, pages.dtype)
    v_q, v_s = quantize_kv(v_new, pages.dtype)
    return stored(k_q), stored(v_q), k_s, v_s


@functools.partial(jax.jit, donate_argnames=("k_pages", "v_pages", "k_scales", "v_scales"))
def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
):
    """Scatter ``k_new``/``v_new`` rows into the pool at ``slot_mapping``; the pool is donated.

    An 8-bit pool (int8 or float8_e4m3fn pages) comes with ``k_scales``/``v_scales``
    f32[num_kv_heads, num_blocks, block_size]: each new row is quantized per KV head
    (``quantize_kv``) and its scale written at the same slot; then the call returns
    ``(k_pages, v_pages, k_scales, v_scales)``, else ``(k_pages, v_pages)``."""
    check_write(k_pages, v_pages, k_new, v_new, slot_mapping, k_scales, v_scales)
    return write_kv_reference(
        k_pages, v_pages, k_new, v_new, slot_mapping, k_scales=k_scales, v_scales=v_scales
    )


def check_write(k_pages, v_pages, k_new, v_new, slot_mapping, k_scales=None, v_scales=None):
    """``write_kv``'s arguments, validated (ValueError naming the bad one)."""
    _check_pages(k_pages, v_pages)
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if k_new.shape != v_new.shape or k_new.ndim != 3:
        raise ValueError(
            f"k_new/v_new must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {k_new.shape} and {v_new.shape}"
        )
    if k_new.shape[1] != k_pages.shape[0] or k_new.shape[2] > k_pages.shape[3]:
        raise ValueError(
            f"k_new rows {k_new.shape[1:]} do not match the pool's "
            f"(num_kv_heads, head_dim) = {(k_pages.shape[0], k_pages.shape[3])}"
        )
    if slot_mapping.shape != (k_new.shape[0],):
        raise ValueError(
            f"slot_mapping shape {slot_mapping.shape} must be ({k_new.shape[0]},), one per token"
        )


def _check_pool_tree(pages) -> int:
    """Every leaf is a [num_kv_heads, num_blocks, block_size, head_dim] pool, all with the same
    num_blocks, or an 8-bit pool's scales [num_kv_heads, num_blocks, block_size] (a TPU's with
    spare rows: pool_layout.py); returns num_blocks."""
    leaves = jax.tree.leaves(pages)
    if not leaves:
        raise ValueError("pages holds no arrays")
    num_blocks = {leaf.shape[1] for leaf in leaves if leaf.ndim == 4}
    pools = num_blocks or {leaf.shape[1] for leaf in leaves if leaf.ndim == 3}
    ok = len(pools) == 1 and all(leaf.ndim in (3, 4) for leaf in leaves)
    if not ok or any(leaf.shape[1] < min(pools) for leaf in leaves):
        raise ValueError(
            "every pool array must be [num_kv_heads, num_blocks, block_size, head_dim] (or scales "
            f"[num_kv_heads, num_blocks, block_size]) with the same num_blocks, got shapes "
            f"{[leaf.shape for leaf in leaves]}"
        )
    return pools.pop()


def _check_ids(name: str, ids: jax.Array) -> None:
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")


def copy_blocks_reference(
    pages,  # [num_kv_heads, num_blocks, block_size, head_dim], or a pytree of such
    src: jax.Array,  # i32[num_pairs]
    dst: jax.Array,  # i32[num_pairs]; a pair with a negative src or dst is skipped
):
    """Copy block ``src[i]`` to block ``dst[i]`` (copy-on-write). All reads see the pool as it was
    before the call; ``dst`` entries must be distinct."""

    def copy(pool):
        num_blocks = pool.shape[1]
        keep = (src >= 0) & (dst >= 0)
        to = jnp.where(keep, dst, num_blocks)  # out of range: dropped (-1 would wrap)
        rows = pool[:, jnp.clip(src, 0, num_blocks - 1)]
        return pool.at[:, to].set(rows, mode="drop")

    return jax.tree.map(copy, pages)


def gather_blocks_reference(
    pages,  # [num_kv_heads, num_blocks, block_size, head_dim], or a pytree of such
    block_ids: jax.Array,  # i32[n]; negative = padding, gives zeros
):  # [num_kv_heads, n, block_size, head_dim] per pool array
    """Blocks to swap out (the caller moves them to host memory)."""

    def gather(pool):
        rows = pool[:, jnp.clip(block_ids, 0, pool.shape[1] - 1)]
        keep = (block_ids >= 0).reshape(1, -1, *(1,) * (rows.ndim - 2))
        return jnp.where(keep, rows, jnp.zeros_like(rows))

    return jax.tree.map(gather, pages)


def scatter_blocks_reference(
    pages,  # [num_kv_heads, num_blocks, block_size, head_dim], or a pytree of such
    block_ids: jax.Array,  # i32[n]; negative = padding, skipped
    blocks,  # [num_kv_heads, n, block_size, head_dim], same tree as pages
):
    """Write swapped-in blocks at ``block_ids`` (distinct)."""

    def scatter(pool, new):
        to = jnp.where(block_ids >= 0, block_ids, pool.shape[1])
        return pool.at[:, to].set(new.astype(pool.dtype), mode="drop")

    return jax.tree.map(scatter, pages, blocks)


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_blocks(pages, src: jax.Array, dst: jax.Array):
    """Copy-on-write: block ``src[i]`` -> block ``dst[i]`` in every pool array; pool donated."""
    _check_pool_tree(pages)
    _check_ids("src", src)
    _check_ids("dst", dst)
    if src.shape != dst.shape:
        raise ValueError(f"src {src.shape} and dst {dst.shape} must have the same shape")
    return copy_blocks_reference(pages, src, dst)


@jax.jit
def gather_blocks(pages, block_ids: jax.Array):
    """Read blocks out for swapping to host; the pool is read, not donated."""
    _check_pool_tree(pages)
    _check_ids("block_ids", block_ids)
    return gather_blocks_reference(pages, block_ids)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(pages, block_ids: jax.Array, blocks):
    """Write blocks swapped back in from host at ``block_ids``; pool donated."""
    _check_pool_tree(pages)
    _check_ids("block_ids", block_ids)
    if jax.tree.structure(pages) != jax.tree.structure(blocks):
        raise ValueError("blocks must have the same tree structure as pages")
    for pool, new in zip(jax.tree.leaves(pages), jax.tree.leaves(blocks), strict=True):
        want = (pool.shape[0], block_ids.shape[0], *pool.shape[2:])
        if new.shape != want:
            raise ValueError(f"blocks shape {new.shape} must be {want} (one per block id)")
    return scatter_blocks_reference(pages, block_ids, blocks)
