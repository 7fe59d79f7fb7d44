"""KV blocks as an operating system manages pages: allocator, block tables, copy-on-write, swap,
and automatic prefix caching.

Pure Python; imports no jax. The device pool holds num_blocks blocks; block 0 is the null block
(never handed out, the target of the runner's padding). The host pool holds swapped-out blocks.
Swapping lives in block_swap.py, prefix matching and hashing in prefix_cache.py, speculation's
lookahead slots in block_lookahead.py, the sliding-window arithmetic in window.py.

Invariants (tests/pagedjax/core/test_block_manager_state_machine.py checks them after every step):
- every device block but the null block is free xor referenced, and its ref count equals the
  number of block tables holding it; likewise for host blocks;
- a block is written only while it has one reference (append_slots copies shared ones first);
- a free block is either pristine (free_block_ids) or holds a computed, hash-registered prefix
  block (evictable, least recently used first).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Sequence_

from pagedjax.core.block_lookahead import LookaheadSlotsMixin
from pagedjax.core.block_pool import (
    AllocStatus,
    Block,
    BlockManagerStats,
    BlockPool,
    HashFn,
    hash_block_tokens,
)
from pagedjax.core.block_swap import HOST_NULL, NULL_BLOCK, SwapMixin
from pagedjax.core.block_view import BlockManagerView, BlockUsage
from pagedjax.core.prefix_cache import PrefixCacheMixin
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedjax.core.window import first_live_block, max_chunk_that_fits, shared_window
from pagedjax.utils import cdiv

WATERMARK = 0.01  # share of the pool kept free for running sequences' growth

__all__ = ["AllocStatus", "BlockManager", "BlockManagerStats", "hash_block_tokens"]


class BlockManager(PrefixCacheMixin, SwapMixin, LookaheadSlotsMixin, BlockPool):
    """Block tables over a BlockPool: admission, growth, copy-on-write, prefix matching, swap.

    With ``sliding_window`` (every layer attends with that one window; see core/window.py), a
    table covers at most ``max_chunk_tokens`` tokens past the sequence's computed ones, and
    ``release_outside_window`` frees the blocks the next step can no longer read: their entries
    become NULL_BLOCK (block 0, never allocated; the kernels skip it, the references read it and
    mask it by position). A shared block stays alive while another table holds it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        watermark: float = WATERMARK,
        enable_prefix_caching: bool = False,
        hash_fn: HashFn = hash_block_tokens,
        sliding_window: int | None = None,
        rope_switch_len: int | None = None,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null one), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        super().__init__(num_blocks, block_size, num_host_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.host_block_tables: dict[int, list[int]] = {}
        self._num_hashed_blocks: dict[int, int] = {}
        self._cache_queries = 0
        self._cache_hits = 0
        self.sliding_window = sliding_window
        # LongRoPE: KV computed with a context past this length uses other rope factors, so the
        # prefix cache keeps the two kinds apart (its key includes which kind a block holds).
        self.rope_switch_len = rope_switch_len
        self.max_chunk_tokens = 2**62  # tokens a table covers past the computed ones (window)
        if sliding_window is not None:
            usable = num_blocks - 1 - self.watermark_blocks
            fit = max_chunk_that_fits(sliding_window, usable, block_size)
            if fit >= 1:  # else the window outgrows the pool: whole tables, as without one
                self.max_chunk_tokens = fit

    @classmethod
    def for_model(cls, num_blocks: int, num_host_blocks: int, cache, model_config):
        """The engine's block manager: cache is a CacheConfig, model_config a ModelConfig."""
        return cls(
            num_blocks,
            cache.block_size,
            num_host_blocks=num_host_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            sliding_window=shared_window(model_config.layer_windows),
            rope_switch_len=model_config.longrope_switch_len,
        )

    def limit_chunk_tokens(self, num_tokens: int) -> None:
        """Cap a windowed table's run-ahead at num_tokens (the scheduler's token budget)."""
        if self.sliding_window is not None:
            self.max_chunk_tokens = min(self.max_chunk_tokens, num_tokens)

    # ---- device blocks -------------------------------------------------------------------------

    def _num_table_tokens(self, table: list[int]) -> int:
        if not table:
            return 0
        last = self.blocks[table[-1]].num_tokens if table[-1] != NULL_BLOCK else self.block_size
        return (len(table) - 1) * self.block_size + last

    def _target_len(self, seq: Sequence, num_computed: int | None = None) -> int:
        """Tokens seq's table must cover for its next step: all of them, or with a window at
        most max_chunk_tokens past its computed ones."""
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        return min(seq.get_len(), num_computed + self.max_chunk_tokens)

    def _first_live(self, num_computed: int) -> int:
        if self.sliding_window is None:
            return 0
        return first_live_block(num_computed, self.sliding_window, self.block_size)

    def release_outside_window(self, seq: Sequence) -> int:
        """Free the blocks of seq that its next step cannot read (sliding window only): their
        entries become NULL_BLOCK. Returns how many entries were released."""
        if self.sliding_window is None or seq.seq_id not in self.block_tables:
            return 0
        table = self.block_tables[seq.seq_id]
        released = 0
        for i in range(min(self._first_live(seq.num_computed_tokens), len(table))):
            if table[i] != NULL_BLOCK:
                self._decref(self.blocks[table[i]])
                table[i] = NULL_BLOCK
                released += 1
        return released

    def num_released(self, seq: Sequence) -> int:
        """Entries of seq's device table released by the window (NULL_BLOCK)."""
        return self._device_table(seq).count(NULL_BLOCK)

    def _grow_table(self, table: list[int], num_tokens: int) -> None:
        """Give table a slot for each of num_tokens tokens; its last block is not shared."""
        covered = self._num_table_tokens(table)
        if covered >= num_tokens:
            return
        if table and covered % self.block_size:
            last = self.blocks[table[-1]]
            fill = min(self.block_size, last.num_tokens + num_tokens - covered)
            self._add_tokens(fill - last.num_tokens)
            last.num_tokens = fill
        while len(table) * self.block_size < num_tokens:
            block = self._take_free_block()
            block.num_tokens = min(self.block_size, num_tokens - len(table) * self.block_size)
            self._add_tokens(block.num_tokens)
            table.append(block.block_id)

    def _device_table(self, seq: Sequence) -> list[int]:
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            where = "on the host (swapped out)" if seq.seq_id in self.host_block_tables else "none"
            raise ValueError(f"seq_id {seq.seq_id} has no device block table (blocks: {where})")
        return table

    def _num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def has_blocks(self, seq: Sequence) -> bool:
        """Whether seq holds blocks (on the device or, swapped out, on the host)."""
        return seq.seq_id in self.block_tables or seq.seq_id in self.host_block_tables

    # ---- admission -----------------------------------------------------------------------------

    def _waiting_seqs(self, group: SequenceGroup) -> list[Sequence]:
        seqs = group.get_seqs(status=SequenceStatus.WAITING)
        if not seqs:
            raise ValueError(f"request {group.request_id!r} has no WAITING sequence to allocate")
        first = seqs[0]
        for seq in seqs:
            if seq.block_size != self.block_size:
                raise ValueError(
                    f"seq_id {seq.seq_id} has block_size {seq.block_size}, "
                    f"the block manager {self.block_size}"
                )
            if self.has_blocks(seq):
                raise ValueError(f"seq_id {seq.seq_id} is WAITING but already holds blocks")
            if seq.get_token_ids() != first.get_token_ids():
                raise ValueError(
                    f"request {group.request_id!r}: WAITING seqs {first.seq_id} and {seq.seq_id} "
                    "have different tokens and cannot share the prompt's blocks"
                )
        return seqs

    def _live_hits(self, hits: list[Block]) -> list[Block]:
        """The hits the first step can read (all of them without a window)."""
        return hits[self._first_live(len(hits) * self.block_size) :]

    def _num_free_blocks_taken(self, seq: Sequence, hits: list[Block]) -> int:
        """Free blocks that allocating seq consumes: new ones, and cached live hits nobody
        holds."""
        target = self._target_len(seq, len(hits) * self.block_size)
        num_new = self._num_blocks_for(target) - len(hits)
        return num_new + sum(block.ref_count == 0 for block in self._live_hits(hits))

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        seq = self._waiting_seqs(group)[0]
        num_required = self._num_blocks_for(self._target_len(seq, 0))
        if self.num_blocks - 1 - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        num_taken = self._num_free_blocks_taken(seq, self._match_prefix(seq))
        if self.get_num_free_blocks() - num_taken >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Give every WAITING seq of group one shared block table for its tokens (all or nothing).

        Sets each seq's num_computed_tokens to the prefix-cache hit length (0 without caching).
        The seqs share every block, so compute the prompt once (vLLM admits one seq and forks).
        """
        seqs = self._waiting_seqs(group)
        seq = seqs[0]
        num_required = self._num_blocks_for(self._target_len(seq, 0))
        if self.num_blocks - 1 - num_required < self.watermark_blocks:  # can_allocate's NEVER
            raise ValueError(
                f"request {group.request_id!r} needs {num_required} blocks, more than the pool's "
                f"{self.num_blocks - 1} less the watermark of {self.watermark_blocks}"
            )
        hits = self._match_prefix(seq)
        num_taken = self._num_free_blocks_taken(seq, hits)
        if num_taken > self.get_num_free_blocks():
            raise ValueError(
                f"request {group.request_id!r} needs {num_required} blocks "
                f"({num_taken} of them free ones), but only {self.get_num_free_blocks()} of the "
                f"pool's {self.num_blocks - 1} are free"
            )
        if self.enable_prefix_caching:
            self._cache_queries += (seq.get_len() - 1) // self.block_size
            self._cache_hits += len(hits)
        live = self._live_hits(hits)
        table = [NULL_BLOCK] * (len(hits) - len(live))  # hits before the window: not held
        for block in live:
            self._incref(block)
            table.append(block.block_id)
        self._grow_table(table, self._target_len(seq, len(hits) * self.block_size))
        for i, s in enumerate(seqs):
            if i:
                for block_id in table:
                    if block_id != NULL_BLOCK:
                        self._incref(self.blocks[block_id])
            self.block_tables[s.seq_id] = list(table)
            self._num_hashed_blocks[s.seq_id] = len(hits)
            s.num_computed_tokens = len(hits) * self.block_size

    # ---- decode --------------------------------------------------------------------------------

    def _write_range(self, seq: Sequence, table: list[int]) -> range:
        """Indices of seq's existing blocks that the next step writes KV into."""
        covered = self._num_table_tokens(table)
        if not 0 <= seq.num_computed_tokens <= covered:
            raise ValueError(
                f"seq_id {seq.seq_id}: num_computed_tokens {seq.num_computed_tokens} is outside "
                f"[0, {covered}] (the tokens its block table holds)"
            )
        return range(seq.num_computed_tokens // self.block_size, len(table))

    def _append_need(self, seqs: list[Sequence], tables: dict[int, list[int]], ref_count) -> int:
        """Free blocks that appending slots to every seq of ``seqs`` (in turn) takes: one per
        missing block, and one per copy of a shared block a seq writes into. The last of a block's
        holders to write into it finds it unshared and writes in place, so it copies nothing."""
        need, writers = 0, collections.Counter()
        for seq in seqs:
            table = tables[seq.seq_id]
            start = seq.num_computed_tokens // self.block_size  # first block the step writes
            writers.update(table[start:])
            need += max(0, self._num_blocks_for(self._target_len(seq)) - len(table))
        for block_id, count in writers.items():
            refs = ref_count(block_id)
            if refs > 1:
                need += count if count < refs else count - 1
        return need

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every RUNNING seq of group can get slots for its tokens not yet in its table."""
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        for seq in seqs:
            self._device_table(seq)
        need = self._append_need(seqs, self.block_tables, lambda b: self.blocks[b].ref_count)
        return need <= self.get_num_free_blocks()

    def append_decode_slot(self, seq: Sequence) -> bool:
        """A decode's fast path (most steps of most sequences): the slot of seq's one new token
        in its last block, when that block has room and seq alone holds it; then nothing is
        copied and no block taken, exactly what ``can_append_slots`` and ``append_slots`` would
        find and do. False (nothing changed) when the general path must run: a new block, a
        shared block to copy, a sliding window, a sequence more than one token ahead."""
        table = self.block_tables.get(seq.seq_id)
        if self.sliding_window is not None or not table:
            return False
        last = self.blocks[table[-1]]
        covered = self._num_table_tokens(table)
        if (
            last.num_tokens >= self.block_size
            or last.ref_count != 1
            or covered != seq.num_computed_tokens
            or seq.get_len() != covered + 1
        ):
            return False
        last.num_tokens += 1
        self._add_tokens(1)
        return True

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give seq slots up to seq.get_len(). Every shared block the next step writes into (from
        token num_computed_tokens on) is first copied: returns the (src, dst) copies to perform."""
        if seq.is_finished():
            raise ValueError(f"cannot append to seq_id {seq.seq_id}: it is {seq.status.name}")
        table = self._device_table(seq)
        write_range = self._write_range(seq, table)
        num_needed = self._append_need([seq], self.block_tables, lambda b: self.blocks[b].ref_count)
        if num_needed > self.get_num_free_blocks():
            raise ValueError(
                f"seq_id {seq.seq_id} needs {num_needed} blocks to append, only "
                f"{self.get_num_free_blocks()} are free (check can_append_slots first)"
            )
        copies = []
        for i in write_range:
            src = self.blocks[table[i]]
            if src.ref_count > 1:
                dst = self._take_free_block()
                dst.num_tokens = src.num_tokens
                self._add_tokens(dst.num_tokens)
                self._decref(src)
                table[i] = dst.block_id
                copies.append((src.block_id, dst.block_id))
        self._grow_table(table, self._target_len(seq))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent."""
        table = self._device_table(parent)
        if self.has_blocks(child):
            raise ValueError(f"cannot fork into seq_id {child.seq_id}: it already holds blocks")
        for block_id in table:
            if block_id != NULL_BLOCK:
                self._incref(self.blocks[block_id])
        self.block_tables[child.seq_id] = list(table)
        self._num_hashed_blocks[child.seq_id] = self._num_hashed_blocks[parent.seq_id]

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, device or host. Its last blocks go first, so that a cached prefix
        outlives its tails in the LRU order."""
        if seq.seq_id in self.block_tables:
            for block_id in reversed(self.block_tables.pop(seq.seq_id)):
                if block_id != NULL_BLOCK:
                    self._decref(self.blocks[block_id])
            del self._num_hashed_blocks[seq.seq_id]
        elif seq.seq_id in self.host_block_tables:
            for host_id in self.host_block_tables.pop(seq.seq_id):
                if host_id != HOST_NULL:
                    self._host_decref(host_id)
            del self._num_hashed_blocks[seq.seq_id]
        else:
            raise ValueError(f"cannot free seq_id {seq.seq_id}: it holds no blocks")

    def get_block_table(self, seq: Sequence) -> list[int]:
        return list(self._device_table(seq))

    def table_of(self, seq_id: int) -> Sequence_[int] | None:
        """seq's device block table itself, read-only (None: it holds none): the list the block
        manager grows, and drops unchanged when the sequence is freed, so that a holder sees
        the last table the sequence held (the step record keeps it, copying nothing)."""
        return self.block_tables.get(seq_id)

    # ---- export --------------------------------------------------------------------------------

    def usage(self) -> BlockUsage:
        return BlockUsage(
            num_used=self.num_blocks - 1 - self.get_num_free_blocks(),
            num_cached=len(self.evictable),
            num_free=len(self.free_block_ids),
            num_host_used=self.num_host_blocks - self.get_num_free_host_blocks(),
        )

    def view(self) -> BlockManagerView:
        """A frozen copy of the pool and every table (core/block_view.py)."""
        return BlockManagerView(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_host_blocks=self.num_host_blocks,
            watermark_blocks=self.watermark_blocks,
            usage=self.usage(),
            ref_counts=tuple(b.ref_count for b in self.blocks),
            num_tokens=tuple(b.num_tokens for b in self.blocks),
            cached=frozenset(self.evictable),
            tables={s: tuple(t) for s, t in self.block_tables.items()},
            host_tables={s: tuple(t) for s, t in self.host_block_tables.items()},
            host_ref_counts=tuple(self.host_ref_counts),
            host_num_tokens=tuple(self.host_num_tokens),
        )

    # ---- accounting ----------------------------------------------------------------------------

    def get_stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_blocks_total=self.num_blocks - 1,
            num_blocks_used=self._num_used,
            num_blocks_peak=self._num_used_peak,
            kv_slots_allocated_peak=self._num_used_peak * self.block_size,
            kv_tokens_stored_peak=self._num_tokens_stored_peak,
            kv_utilization=self._usage_tokens / self._usage_slots if self._usage_slots else 0.0,
            prefix_cache_queries=self._cache_queries,
            prefix_cache_hits=self._cache_hits,
            prefix_cache_hit_rate=(
                self._cache_hits / self._cache_queries if self._cache_queries else 0.0
            ),
            num_swapped_out=self._num_swapped_out,
            num_swapped_in=self._num_swapped_in,
        )
