"""Host-side pieces every Pallas kernel wrapper shares: the sizes read off ``(q, kv, md)``, the
context lengths clipped to the table's capacity, the block table padded to whole key blocks and
the queries grouped by KV head. The kernels themselves stay in their backend's folder."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import metadata as m
from ._common import cdiv, pad_block_tables


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one attention call."""

    num_rows: int  # q's first axis: sequences (decode) or packed tokens (ragged)
    num_heads: int
    head_dim: int
    num_kv_heads: int
    num_blocks: int
    block_size: int
    num_seqs: int
    max_blocks: int  # block-table columns

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads


def geometry(q: jax.Array, kv: m.PagedKV, md: m.AttentionMetadata) -> Geometry:
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = kv.k_pages.shape
    num_seqs, max_blocks = md.block_tables.shape
    return Geometry(
        num_rows=num_rows,
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        num_blocks=num_blocks,
        block_size=block_size,
        num_seqs=num_seqs,
        max_blocks=max_blocks,
    )


def clipped_lens(md: m.AttentionMetadata, g: Geometry) -> jax.Array:  # i32[num_seqs]
    """Lengths past the table's capacity would read padding: clip as the reference does."""
    return jnp.minimum(md.context_lens.astype(jnp.int32), g.max_blocks * g.block_size)


def whole_blocks_table(md: m.AttentionMetadata, g: Geometry, pages_per_block: int) -> jax.Array:
    """i32[num_seqs, cols]: the block table padded with the null block to whole key blocks of
    ``pages_per_block`` pages (at least one)."""
    cols = cdiv(max(g.max_blocks, 1), pages_per_block) * pages_per_block
    return pad_block_tables(md.block_tables.astype(jnp.int32), cols)


def grouped_queries(
    q: jax.Array, g: Geometry, *, pad_rows: int = 0, group_to: int | None = None
) -> jax.Array:  # [num_rows + pad_rows, num_kv_heads, group_to, head_dim]
    """q's heads grouped by their KV head; ``pad_rows`` zero rows appended, the group padded with
    zero heads up to ``group_to`` (default: the group itself)."""
    qg = q.reshape(g.num_rows, g.num_kv_heads, g.group, g.head_dim)
    extra_heads = (group_to or g.group) - g.group
    if pad_rows or extra_heads:
        qg = jnp.pad(qg, ((0, pad_rows), (0, 0), (0, extra_heads), (0, 0)))
    return qg
