"""The block allocator under the block manager: device blocks with reference counts, a free list
of pristine blocks (lowest id first), an LRU of cached prefix blocks (free but still holding their
KV, evicted only when no pristine block is left), host blocks for swapping, and usage counters.

Pure Python; imports no jax. Block 0 is the null block: never handed out, the target of the
runner's padding.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator

# hash_fn(parent_hash, token_ids, extra_key) -> hash of a full block, chained over its prefix.
HashFn = Callable[[int | None, tuple[int, ...], Hashable], int]


def hash_block_tokens(
    parent_hash: int | None, token_ids: tuple[int, ...], extra_key: Hashable
) -> int:
    return hash((parent_hash, token_ids, extra_key))


class AllocStatus(enum.Enum):
    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once running sequences free blocks
    NEVER = enum.auto()  # larger than the pool (less the watermark): reject the request


@dataclasses.dataclass(frozen=True)
class BlockManagerStats:
    num_blocks_total: int  # allocatable device blocks (the null block excluded)
    num_blocks_used: int  # referenced now; cached blocks nobody references count as free
    num_blocks_peak: int
    kv_slots_allocated_peak: int  # num_blocks_peak * block_size
    kv_tokens_stored_peak: int  # a block shared by several sequences counts its tokens once
    kv_utilization: float  # tokens stored / slots allocated, summed over record_usage() samples
    prefix_cache_queries: int  # full prompt blocks looked up in the prefix cache
    prefix_cache_hits: int  # of those, found cached (computed, same prefix and tokens)
    prefix_cache_hit_rate: float
    num_swapped_out: int  # blocks copied device -> host
    num_swapped_in: int  # blocks copied host -> device


class LowestFirst:
    """Free ids, handed out lowest first (a min-heap). A sequence's blocks then come from the low
    end of the pool, ascending: several allocated at once (a prompt's) are neighbours in memory,
    which a CPU reads at about twice the rate of scattered ones, and the pool's live part stays
    compact. Iterates in ascending order."""

    def __init__(self, ids: Iterable[int]):
        self._heap = list(ids)
        heapq.heapify(self._heap)

    def append(self, block_id: int) -> None:
        heapq.heappush(self._heap, block_id)

    def pop(self) -> int:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._heap))


class Block:
    __slots__ = ("block_id", "ref_count", "num_tokens", "generation", "hash", "key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.num_tokens = 0  # slots holding a token; equal for all holders of a shared block
        self.generation = 0  # bumped on every fresh allocation: tells a reused block apart
        # Set once the block is full and its KV computed (prefix caching only). key is what a
        # cache hit must match exactly: (parent identity, token ids, extra key).
        self.hash: int | None = None
        self.key: tuple | None = None

    def identity(self) -> tuple[int, int]:
        return self.block_id, self.generation


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = LowestFirst(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block_id: dict[int, int] = {}

        self.host_ref_counts = [0] * num_host_blocks
        self.host_num_tokens = [0] * num_host_blocks
        self.free_host_block_ids: deque[int] = deque(range(num_host_blocks))

        self._num_used = 0
        self._num_tokens_stored = 0
        self._num_used_peak = 0
        self._num_tokens_stored_peak = 0
        self._usage_tokens = 0
        self._usage_slots = 0
        self._num_swapped_out = 0
        self._num_swapped_in = 0

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    def get_num_free_host_blocks(self) -> int:
        return len(self.free_host_block_ids)

    def _take_free_block(self) -> Block:
        # Pristine blocks first; evicting a cached prefix only when none is left.
        if self.free_block_ids:
            block = self.blocks[self.free_block_ids.pop()]
        else:
            block = self.blocks[self.evictable.popitem(last=False)[0]]
            self._uncache(block)
        block.generation += 1
        block.ref_count = 1
        block.num_tokens = 0
        self._num_used += 1
        self._num_used_peak = max(self._num_used_peak, self._num_used)
        return block

    def _uncache(self, block: Block) -> None:
        if self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = block.key = None

    def _incref(self, block: Block) -> None:
        if block.ref_count == 0:  # a cached block brought back by a prefix hit
            del self.evictable[block.block_id]
            self._num_used += 1
            self._num_used_peak = max(self._num_used_peak, self._num_used)
            self._add_tokens(block.num_tokens)
        block.ref_count += 1

    def _decref(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count:
            return
        self._num_used -= 1
        self._add_tokens(-block.num_tokens)
        # A computed full block stays cached (unless another block holds its hash) until evicted.
        registered = block.hash is not None and (
            self.hash_to_block_id.setdefault(block.hash, block.block_id) == block.block_id
        )
        if registered:
            self.evictable[block.block_id] = None  # most recently used last
        else:
            self._uncache(block)
            self.free_block_ids.append(block.block_id)

    def _add_tokens(self, n: int) -> None:
        self._num_tokens_stored += n
        self._num_tokens_stored_peak = max(self._num_tokens_stored_peak, self._num_tokens_stored)

    def _host_decref(self, host_id: int) -> None:
        self.host_ref_counts[host_id] -= 1
        if not self.host_ref_counts[host_id]:
            self.free_host_block_ids.append(host_id)

    def record_usage(self) -> None:
        """Sample tokens stored vs slots allocated; the engine calls this once per step."""
        self._usage_tokens += self._num_tokens_stored
        self._usage_slots += self._num_used * self.block_size
