"""What the block manager exports for inspection: a frozen copy of the pool and its tables.

Pure Python. ``BlockManager.view()`` builds a ``BlockManagerView`` (every block, every table:
for ``engine.inspect()`` and snapshots), ``BlockManager.usage()`` the four counts a step record
keeps (cheap enough for every step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class BlockUsage:
    num_used: int  # device blocks held by a sequence
    num_cached: int  # device blocks free but holding a cached prefix (evictable)
    num_free: int  # device blocks holding nothing (the null block excluded)
    num_host_used: int  # host (swap space) blocks held by a swapped-out sequence


@dataclasses.dataclass(frozen=True)
class BlockManagerView:
    """The pool and the tables at one moment; block 0 is the null block."""

    block_size: int
    num_blocks: int
    num_host_blocks: int
    watermark_blocks: int
    usage: BlockUsage
    ref_counts: tuple[int, ...]  # per device block
    num_tokens: tuple[int, ...]  # per device block: slots holding a token
    cached: frozenset[int]  # device blocks free but holding a cached prefix
    tables: Mapping[int, tuple[int, ...]]  # seq id -> its device block table
    host_tables: Mapping[int, tuple[int, ...]]  # seq id -> its host block table (swapped out)
    host_ref_counts: tuple[int, ...]  # per host block
    host_num_tokens: tuple[int, ...]  # per host block

    def block_state(self, block_id: int) -> str:
        """ "null", "used", "cached" or "free"."""
        if block_id == 0:
            return "null"
        if self.ref_counts[block_id]:
            return "used"
        return "cached" if block_id in self.cached else "free"

    @property
    def host_blocks_in_use(self) -> tuple[int, ...]:
        """Host blocks holding a swapped-out sequence's KV, ascending."""
        return tuple(h for h, refs in enumerate(self.host_ref_counts) if refs)
