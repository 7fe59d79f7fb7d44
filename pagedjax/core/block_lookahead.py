"""Speculative decoding's slots (the BlockManager's lookahead half): room for proposed tokens
past a sequence's end, taken from free blocks above the watermark only, and given back when
the target rejects them. Pure Python; imports no jax.

A lookahead slot holds no computed token until the step that verifies its proposal writes it;
trimming never frees a computed token's slot, and never shrinks a shared last block.
"""

from __future__ import annotations

from pagedjax.core.sequence import Sequence


class LookaheadSlotsMixin:
    """Needs the BlockManager's _device_table, _num_table_tokens, _grow_table,
    _num_blocks_for, watermark_blocks and the pool."""

    def append_lookahead_slots(self, seq: Sequence, num_slots: int) -> int:
        """Speculation, after append_slots: slots for up to num_slots proposed tokens past seq's
        end, from free blocks above the watermark only. Returns how many it gave; trim_slots
        gives back those of rejected tokens."""
        table = self._device_table(seq)
        covered = self._num_table_tokens(table)
        if covered != seq.get_len():
            raise ValueError(f"seq_id {seq.seq_id}: {covered} slots for {seq.get_len()} tokens")
        spare = max(0, self.get_num_free_blocks() - self.watermark_blocks)
        num_slots = max(0, min(num_slots, (len(table) + spare) * self.block_size - covered))
        self._grow_table(table, covered + num_slots)
        return num_slots

    def trim_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only seq's first num_tokens slots (at least its computed tokens): the blocks past
        them go back to the pool (speculation rolled back; they hold no computed token)."""
        table = self._device_table(seq)
        if not seq.num_computed_tokens <= num_tokens <= self._num_table_tokens(table):
            raise ValueError(f"seq_id {seq.seq_id}: cannot trim its table to {num_tokens} slots")
        keep = self._num_blocks_for(num_tokens)
        for block_id in reversed(table[keep:]):
            self._decref(self.blocks[block_id])
        del table[keep:]
        if table:
            last = self.blocks[table[-1]]
            fill = num_tokens - (keep - 1) * self.block_size
            if fill != last.num_tokens and last.ref_count > 1:
                raise ValueError(f"seq_id {seq.seq_id}: its last block {last.block_id} is shared")
            self._add_tokens(fill - last.num_tokens)
            last.num_tokens = fill
