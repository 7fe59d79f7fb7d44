"""Swapping a group's blocks between the device pool and host memory (the BlockManager's swap
half). Pure Python; imports no jax.

A block table entry freed by the sliding-window rule (NULL_BLOCK on the device) is not moved: it
becomes HOST_NULL in the host table and NULL_BLOCK again on swap-in, so only live blocks travel.
"""

from __future__ import annotations

from pagedjax.core.block_pool import AllocStatus
from pagedjax.core.sequence import SequenceGroup

NULL_BLOCK = 0  # a device table entry whose block was freed (never read: before the window)
HOST_NULL = -1  # the same entry in a host table


class SwapMixin:
    """Needs the BlockManager's block_tables, host_block_tables, _append_need and the pool."""

    def _distinct_blocks(self, group: SequenceGroup, tables: dict[int, list[int]]) -> set[int]:
        live = {b for seq in group.get_seqs() for b in tables.get(seq.seq_id, ())}
        return live - {NULL_BLOCK, HOST_NULL} if tables is self.block_tables else live - {HOST_NULL}

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._distinct_blocks(group, self.block_tables)) <= len(self.free_host_block_ids)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move every seq of group that holds device blocks to the host. Returns the
        (device_block, host_block) copies to perform; a shared block moves once."""
        seqs = [seq for seq in group.get_seqs() if seq.seq_id in self.block_tables]
        if not seqs:
            raise ValueError(f"request {group.request_id!r} holds no device blocks to swap out")
        num_needed = len(self._distinct_blocks(group, self.block_tables))
        if num_needed > len(self.free_host_block_ids):
            raise ValueError(
                f"request {group.request_id!r} needs {num_needed} host blocks to swap out, "
                f"only {len(self.free_host_block_ids)} of {self.num_host_blocks} are free"
            )
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = self.block_tables.pop(seq.seq_id)
            host_table = []
            for block_id in table:
                if block_id == NULL_BLOCK:
                    host_table.append(HOST_NULL)
                    continue
                host_id = mapping.get(block_id)
                if host_id is None:
                    host_id = self.free_host_block_ids.popleft()
                    self.host_num_tokens[host_id] = self.blocks[block_id].num_tokens
                    mapping[block_id] = host_id
                self.host_ref_counts[host_id] += 1
                host_table.append(host_id)
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._decref(self.blocks[block_id])
            self.host_block_tables[seq.seq_id] = host_table
            self._num_hashed_blocks[seq.seq_id] = 0  # new device blocks on swap-in: rehash
        self._num_swapped_out += len(mapping)
        return list(mapping.items())

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Room for the group's blocks and for the slots its seqs append right after (exact, so
        that a group that fitted the pool before it was swapped out always fits it again)."""
        seqs = [seq for seq in group.get_seqs() if seq.seq_id in self.host_block_tables]
        num_required = len(self._distinct_blocks(group, self.host_block_tables))
        num_required += self._append_need(
            seqs, self.host_block_tables, lambda h: self.host_ref_counts[h]
        )
        if num_required > self.num_blocks - 1 - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move every seq of group that holds host blocks back to the device. Returns the
        (host_block, device_block) copies to perform; a shared block moves once."""
        seqs = [seq for seq in group.get_seqs() if seq.seq_id in self.host_block_tables]
        if not seqs:
            raise ValueError(f"request {group.request_id!r} holds no host blocks to swap in")
        num_needed = len(self._distinct_blocks(group, self.host_block_tables))
        if num_needed > self.get_num_free_blocks():
            raise ValueError(
                f"request {group.request_id!r} needs {num_needed} device blocks to swap in, "
                f"only {self.get_num_free_blocks()} are free"
            )
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = []
            for host_id in self.host_block_tables.pop(seq.seq_id):
                if host_id == HOST_NULL:
                    table.append(NULL_BLOCK)
                    continue
                block_id = mapping.get(host_id)
                if block_id is None:
                    block = self._take_free_block()
                    block.num_tokens = self.host_num_tokens[host_id]
                    self._add_tokens(block.num_tokens)
                    mapping[host_id] = block_id = block.block_id
                else:
                    self._incref(self.blocks[block_id])
                self._host_decref(host_id)
                table.append(block_id)
            self.block_tables[seq.seq_id] = table
        self._num_swapped_in += len(mapping)
        return list(mapping.items())
