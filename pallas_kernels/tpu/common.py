"""Mosaic TPU helpers: double-buffered page copies from the HBM pool into VMEM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._common import cdiv


def interpret_params(interpret: bool):
    """``interpret=True`` runs a kernel in TPU interpret mode (also reachable, for whole
    programs, through ``pltpu.force_tpu_interpret_mode``)."""
    return pltpu.InterpretParams() if interpret else False


def compiler_params(num_grid_dims: int):
    # Every program is self-contained (no state carried across grid steps), so all grid
    # dimensions may run in any order and be split across TensorCores.
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * num_grid_dims)


def kv_buffers(*, pages_per_block: int, block_size: int, head_dim: int, dtype):
    """Scratch: K and V double buffers [2, block_k, head_dim] and their DMA semaphores [kv, slot].

    A block of pages is copied page by page into consecutive rows, so the kernel reads a 2-D
    [block_k, head_dim] tile without reshaping.
    """
    buf = pltpu.VMEM((2, pages_per_block * block_size, head_dim), dtype)
    return [buf, buf, pltpu.SemaphoreType.DMA((2, 2))]


def scale_buffers(*, pages_per_block: int, width: int):
    """Scratch of an 8-bit pool: K and V scale double buffers f32[2, pages_per_block, width],
    each page's whole scale row (``width`` columns: a TPU pool's rows are 128-lane padded,
    pool_layout.py, since a DMA moves whole 512-byte rows)."""
    buf = pltpu.VMEM((2, pages_per_block, width), jnp.float32)
    return [buf, buf]


def block_scales(rows, block_size: int):
    """f32[1, pages * block_size]: the scales of a key block's tokens in order (they multiply
    the logits' columns and the probabilities), from its pages' rows f32[pages, width]."""
    pages = rows.shape[0]
    return jnp.concatenate([rows[j : j + 1, :block_size] for j in range(pages)], axis=1)


def page_copies(k_hbm, v_hbm, k_buf, v_buf, sems, *, head, page_ids, slot, scales=None):
    """Copy descriptors bringing pages ``page_ids`` (scalars) of KV head ``head`` into ``slot``;
    ``scales`` (an 8-bit pool's ``(ks_hbm, vs_hbm, ks_buf, vs_buf)``) adds the pages' scales,
    signalling the same semaphores.

    The same call builds the descriptors to ``start`` and, later, to ``wait`` on.
    """
    block_size = k_hbm.shape[2]
    copies = []
    for j, page in enumerate(page_ids):
        rows = pl.ds(j * block_size, block_size)
        copies.append(
            pltpu.make_async_copy(k_hbm.at[head, page], k_buf.at[slot, rows], sems.at[0, slot])
        )
        copies.append(
            pltpu.make_async_copy(v_hbm.at[head, page], v_buf.at[slot, rows], sems.at[1, slot])
        )
        if scales is not None:  # the page's whole scale row (block_scales picks its tokens)
            ks_hbm, vs_hbm, ks_buf, vs_buf = scales
            for kv, (src, dst) in enumerate(((ks_hbm, ks_buf), (vs_hbm, vs_buf))):
                copies.append(
                    pltpu.make_async_copy(
                        src.at[head, pl.ds(page, 1)], dst.at[slot, pl.ds(j, 1)], sems.at[kv, slot]
                    )
                )
    return copies


def paged_flash_loop(*, num_steps, fetch, compute, init, first_step=0):
    """``fori_loop`` over key blocks ``first_step..num_steps - 1`` with the next block's pages in
    flight during each step.

    fetch(i, slot) -> copy descriptors for key block i into buffer ``slot``;
    compute(i, slot, carry) -> carry, called once block i has landed.
    """

    @pl.when(first_step < num_steps)
    def _():
        for copy in fetch(first_step, jax.lax.rem(first_step, 2)):
            copy.start()

    def step(i, carry):
        slot = jax.lax.rem(i, 2)

        @pl.when(i + 1 < num_steps)
        def _():
            for copy in fetch(i + 1, 1 - slot):
                copy.start()

        for copy in fetch(i, slot):
            copy.wait()
        return compute(i, slot, carry)

    return jax.lax.fori_loop(first_step, num_steps, step, init)


def live_page_id(table_ref, index, page, length, block_size, lo=None):
    """Block id of ``page`` read at ``table_ref[index]``; the null block once past the length or,
    given the first key seen ``lo``, for a page wholly before it."""
    live = page < cdiv(length, block_size)
    if lo is not None:
        live &= (page + 1) * block_size > lo
    return jnp.where(live, table_ref[index], 0)
