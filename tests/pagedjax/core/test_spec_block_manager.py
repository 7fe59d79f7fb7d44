"""The block manager's state machine (core/test_block_manager_state_machine.py) with one
more rule: a speculative decode step. Each up-to-date sequence takes lookahead slots for up to k
proposals, writes their K/V, accepts a prefix of them plus one token of the target's own, and
gives the rest back. Every invariant of the plain machine is checked after each rule: blocks free
xor referenced, computed tokens read back as their own prefix's K/V, cached blocks hold exactly
their key's tokens (so no rejected proposal is ever cached), nothing leaks."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import precondition, rule
from test_block_manager_state_machine import RUNNING, BlockManagerMachine

from pagedjax.core.block_manager import BlockManager
from pagedjax.core.sequence import Sequence, SequenceGroup

TARGET_TOKEN = 2  # the target's own token after the accepted proposals; proposals are 0 or 1


class SpeculativeMachine(BlockManagerMachine):
    @precondition(lambda self: self.running_seqs())
    @rule(
        k=st.integers(1, 6),
        accept=st.integers(0, 6),
        proposals=st.lists(st.integers(0, 1), min_size=6, max_size=6),
    )
    def speculative_step(self, k, accept, proposals):
        bm, bs = self.bm, self.bs
        for group in self.groups_with(RUNNING):
            if not bm.can_append_slots(group):
                continue
            for seq in self.schedule(group):  # slots up to each sequence's end, copy on write
                length = seq.get_len()
                if length - seq.num_computed_tokens != 1:
                    continue  # a prompt still to compute: no proposals
                free, held = bm.get_num_free_blocks(), len(bm.get_block_table(seq))
                n = bm.append_lookahead_slots(seq, k)
                table = bm.get_block_table(seq)
                assert 0 <= n <= k and len(table) == -(-(length + n) // bs)
                assert len(table) - held <= max(0, free - bm.watermark_blocks), "took reserve"
                self.covered[seq.seq_id] = length + n
                drafted = seq.get_token_ids() + proposals[:n]
                for t in range(length - 1, length + n):  # the last token, then the proposals
                    block_id = table[t // bs]
                    assert block_id != 0 and bm.blocks[block_id].ref_count == 1, "shared write"
                    self.device[block_id][t % bs] = tuple(drafted[: t + 1])
                num_accepted = min(accept, n)
                for token in proposals[:num_accepted] + [TARGET_TOKEN]:
                    seq.append_token_id(token)
                seq.num_computed_tokens = length + num_accepted
                bm.trim_slots(seq, seq.num_computed_tokens)
                self.covered[seq.seq_id] = seq.num_computed_tokens
                bm.mark_blocks_computed(seq)
        bm.record_usage()


class SpeculativePrefixCachingMachine(SpeculativeMachine):
    enable_prefix_caching = True


_settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSpeculativeStateMachine = SpeculativeMachine.TestCase
TestSpeculativeStateMachine.settings = _settings
TestSpeculativePrefixCachingStateMachine = SpeculativePrefixCachingMachine.TestCase
TestSpeculativePrefixCachingStateMachine.settings = _settings


def test_trim_keeps_computed_tokens_and_frees_the_rest():
    bm = BlockManager(8, 4)
    seq = Sequence(0, [5, 6, 7], 4)
    bm.allocate(SequenceGroup("r", [seq], 0.0))
    seq.num_computed_tokens = 2
    bm.append_slots(seq)
    assert bm.append_lookahead_slots(seq, 6) == 6  # 9 slots: three blocks
    assert len(bm.get_block_table(seq)) == 3 and bm.get_num_free_blocks() == 4
    with pytest.raises(ValueError, match="cannot trim"):
        bm.trim_slots(seq, 1)  # below its computed tokens
    with pytest.raises(ValueError, match="cannot trim"):
        bm.trim_slots(seq, 10)  # more slots than it holds
    bm.trim_slots(seq, 5)
    assert len(bm.get_block_table(seq)) == 2 and bm.get_num_free_blocks() == 5
    assert bm.blocks[bm.get_block_table(seq)[-1]].num_tokens == 1
    bm.free(seq)
    assert bm.get_num_free_blocks() == 7 and bm.get_stats().num_blocks_used == 0


def test_lookahead_needs_the_table_up_to_date_and_spares_the_watermark():
    bm = BlockManager(10, 4, watermark=0.2)  # 2 blocks of reserve
    seq = Sequence(0, [5, 6, 7, 8, 9], 4)
    bm.allocate(SequenceGroup("r", [seq], 0.0))
    seq.append_token_id(3)
    with pytest.raises(ValueError, match="5 slots for 6 tokens"):
        bm.append_lookahead_slots(seq, 2)
    seq.num_computed_tokens = 5
    bm.append_slots(seq)
    # 7 free blocks, 2 reserved: 5 more blocks (20 slots) past the 2 it holds (2 slots spare)
    assert bm.append_lookahead_slots(seq, 32) == 22
    assert bm.get_num_free_blocks() == 2
