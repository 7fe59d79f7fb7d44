"""Random add / fork / append / finish / preempt / swap out / swap in / abort sequences against the
BlockManager, with a simulated KV pool: the runner's copies are applied, each step writes its
tokens' KV, and every computed token must read back as the KV of its own prefix (with a sliding
window: every token the next step can still read; the blocks before the window are released)."""

import copy
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_block_manager import state

from pagedjax.core.block_manager import AllocStatus, BlockManager, hash_block_tokens
from pagedjax.core.block_swap import HOST_NULL, NULL_BLOCK
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedjax.core.window import first_live_block, live_blocks

RUNNING, SWAPPED, WAITING = SequenceStatus.RUNNING, SequenceStatus.SWAPPED, SequenceStatus.WAITING


def colliding_hash(parent_hash, token_ids, extra_key):
    return hash(token_ids) % 3  # collides all the time: only the exact-key check keeps hits right


def kv_of(seq, t):
    """The KV a model writes for token t depends on the whole prefix up to t."""
    return tuple(seq.get_token_ids()[: t + 1])


class BlockManagerMachine(RuleBasedStateMachine):
    enable_prefix_caching = False
    windowed = False

    def __init__(self):
        super().__init__()
        self.bm = None

    @initialize(
        num_blocks=st.one_of(st.integers(2, 6), st.integers(6, 48)),
        block_size=st.integers(1, 4),
        num_host_blocks=st.one_of(st.just(0), st.integers(1, 32)),
        watermark=st.sampled_from([0.0, 0.1]),
        colliding=st.booleans(),
        window=st.integers(1, 9),
    )
    def setup(self, num_blocks, block_size, num_host_blocks, watermark, colliding, window):
        self.window = window if self.windowed else None
        self.bm = BlockManager(
            num_blocks,
            block_size,
            num_host_blocks=num_host_blocks,
            watermark=watermark,
            enable_prefix_caching=self.enable_prefix_caching,
            hash_fn=colliding_hash if colliding else hash_block_tokens,
            sliding_window=self.window,
        )
        self.bs = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]
        self.waiting: list[SequenceGroup] = []
        self.groups: list[SequenceGroup] = []  # admitted, not finished
        self.covered: dict[int, int] = {}  # seq_id -> tokens its block table holds
        self.next_id = 0

    # ---- helpers -------------------------------------------------------------------------------

    def snapshot(self):
        return state(self.bm)

    def groups_with(self, status):
        return [g for g in self.groups if g.num_seqs(status)]

    def running_seqs(self):
        return [s for g in self.groups for s in g.get_seqs(RUNNING)]

    def first_live(self, seq) -> int:
        if self.window is None:
            return 0
        return first_live_block(seq.num_computed_tokens, self.window, self.bs)

    def target(self, seq) -> int:
        """Tokens the table covers after allocate / append_slots (a window: one chunk ahead)."""
        return min(seq.get_len(), seq.num_computed_tokens + self.bm.max_chunk_tokens)

    def new_id(self):
        self.next_id += 1
        return self.next_id

    # ---- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self.waiting) < 4)
    @rule(
        prefix=st.sampled_from([(), (0, 1, 1, 0, 1, 0, 0, 1), (1, 1, 1, 1)]),
        tail=st.lists(st.integers(0, 1), min_size=0, max_size=4),
        n=st.integers(1, 3),
        salt=st.sampled_from([None, "tenant-b"]),
    )
    def add_request(self, prefix, tail, n, salt):
        prompt = list(prefix) + tail or [0]
        seqs = [Sequence(self.new_id(), prompt, self.bs, extra_hash_key=salt) for _ in range(n)]
        self.waiting.append(SequenceGroup(f"req-{self.next_id}", seqs, arrival_time=0.0))

    def admit_first(self) -> bool:
        group = self.waiting[0]
        status = self.bm.can_allocate(group)
        before = self.snapshot()
        try:
            self.bm.allocate(group)
        except ValueError:
            assert status is not AllocStatus.OK
            assert self.snapshot() == before  # all or nothing
            if status is AllocStatus.NEVER:
                self.waiting.pop(0)
                return True
            return False
        assert status is not AllocStatus.NEVER
        self.waiting.pop(0)
        self.groups.append(group)
        for seq in group.get_seqs(WAITING):
            n = seq.num_computed_tokens
            assert n % self.bs == 0 and 0 <= n < seq.get_len()
            if not self.enable_prefix_caching:
                assert n == 0
            seq.status = RUNNING
            self.covered[seq.seq_id] = self.target(seq)
        return True

    @precondition(lambda self: self.running_seqs())
    @rule(i=st.integers(0, 10**6))
    def fork(self, i):
        seqs = self.running_seqs()
        parent = seqs[i % len(seqs)]
        child = parent.fork(self.new_id())
        self.bm.fork(parent, child)
        next(g for g in self.groups if parent in g.get_seqs()).add(child)
        self.covered[child.seq_id] = self.covered[parent.seq_id]

    @precondition(lambda self: self.waiting or self.groups_with(RUNNING))
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4), chunk=st.integers(1, 6))
    def step(self, tokens, chunk):
        """One engine step: admit waiting groups FCFS while the pool allows, schedule every
        running group that fits (append slots, copy on write), execute (write the KV of at most
        chunk tokens per sequence: chunked prefill), sample a token for each sequence that has
        computed all its tokens."""
        for seq in self.running_seqs():
            released = self.bm.release_outside_window(seq)
            assert self.window is not None or released == 0
        while self.waiting and self.admit_first():
            pass
        seqs = []
        for group in self.groups_with(RUNNING):
            if self.decode_fast_path(group):
                seqs += group.get_seqs(RUNNING)
            elif self.bm.can_append_slots(group):
                seqs += self.schedule(group)
        for j, seq in enumerate(seqs):
            table = self.bm.get_block_table(seq)
            if self.window is not None:  # bounded by the window, not by the sequence's length
                live = sum(b != NULL_BLOCK for b in table)
                assert live <= live_blocks(self.window, self.bm.max_chunk_tokens, self.bs)
            end = min(self.covered[seq.seq_id], seq.num_computed_tokens + chunk)
            for t in range(seq.num_computed_tokens, end):
                block_id = table[t // self.bs]
                assert block_id != 0
                assert self.bm.blocks[block_id].ref_count == 1, "wrote a shared block"
                self.device[block_id][t % self.bs] = kv_of(seq, t)
            seq.num_computed_tokens = end
            self.bm.mark_blocks_computed(seq)
            if end == seq.get_len():
                seq.append_token_id(tokens[j % len(tokens)])
        self.bm.record_usage()
        assert 0.0 <= self.bm.get_stats().kv_utilization <= 1.0

    def decode_fast_path(self, group) -> bool:
        """The scheduler's fast path for a one-sequence group: where append_decode_slot takes
        it, the block manager must be as can_append_slots and append_slots would leave it (on a
        copy), with nothing to copy; where it does not, unchanged."""
        seqs = group.get_seqs(RUNNING)
        if len(seqs) != 1:
            return False
        before, general = self.snapshot(), copy.deepcopy(self.bm)
        if not self.bm.append_decode_slot(seqs[0]):
            assert self.snapshot() == before
            return False
        assert general.can_append_slots(group) and general.append_slots(seqs[0]) == []
        assert state(general) == self.snapshot()
        self.covered[seqs[0].seq_id] = self.target(seqs[0])
        return True

    def schedule(self, group):
        seqs = group.get_seqs(RUNNING)
        for seq in seqs:
            for src, dst in self.bm.append_slots(seq):
                assert 0 not in (src, dst) and self.bm.blocks[dst].ref_count == 1
                self.device[dst] = list(self.device[src])
            self.covered[seq.seq_id] = self.target(seq)
        return seqs

    @precondition(lambda self: self.running_seqs())
    @rule(i=st.integers(0, 10**6))
    def finish(self, i):
        seqs = self.running_seqs()
        seq = seqs[i % len(seqs)]
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED_STOPPED
        self.groups = [g for g in self.groups if not g.is_finished()]
        before = self.snapshot()
        with pytest.raises(ValueError, match="FINISHED"):
            self.bm.append_slots(seq)
        with pytest.raises(ValueError, match=str(seq.seq_id)):
            self.bm.free(seq)  # freed twice: an unknown sequence now
        assert self.snapshot() == before

    @precondition(lambda self: self.groups_with(RUNNING))
    @rule(i=st.integers(0, 10**6))
    def preempt_by_recompute(self, i):
        groups = [g for g in self.groups_with(RUNNING) if g.num_seqs(RUNNING) == 1]
        if not groups:
            return
        group = groups[i % len(groups)]
        seq = group.get_seqs(RUNNING)[0]
        self.bm.free(seq)
        seq.status = WAITING
        seq.num_computed_tokens = 0
        self.groups.remove(group)
        self.waiting.insert(0, group)

    @precondition(lambda self: self.groups_with(RUNNING))
    @rule(i=st.integers(0, 10**6))
    def swap_out(self, i):
        groups = self.groups_with(RUNNING)
        group = groups[i % len(groups)]
        before = self.snapshot()
        if not self.bm.can_swap_out(group):
            try:
                self.bm.swap_out(group)
            except ValueError:
                assert self.snapshot() == before
                return
            raise AssertionError("swap_out succeeded although can_swap_out said no")
        mapping = self.bm.swap_out(group)
        assert len({d for d, _ in mapping}) == len({h for _, h in mapping}) == len(mapping)
        for device_block, host_block in mapping:
            assert device_block != 0
            self.host[host_block] = list(self.device[device_block])
        for seq in group.get_seqs(RUNNING):
            seq.status = SWAPPED

    @precondition(lambda self: self.groups_with(SWAPPED))
    @rule(i=st.integers(0, 10**6))
    def swap_in(self, i):
        groups = self.groups_with(SWAPPED)
        group = groups[i % len(groups)]
        status = self.bm.can_swap_in(group)
        before = self.snapshot()
        try:
            mapping = self.bm.swap_in(group)
        except ValueError:
            assert status is not AllocStatus.OK
            assert self.snapshot() == before
            return
        assert len({d for _, d in mapping}) == len(mapping)
        for host_block, device_block in mapping:
            assert device_block != 0
            self.device[device_block] = list(self.host[host_block])
        for seq in group.get_seqs(SWAPPED):
            seq.status = RUNNING

    @precondition(lambda self: len(self.groups) + len(self.waiting) >= 3)
    @rule(i=st.integers(0, 10**6))
    def abort(self, i):
        groups = self.groups + self.waiting
        group = groups[i % len(groups)]
        for seq in group.get_seqs():
            if self.bm.has_blocks(seq):
                self.bm.free(seq)
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_ABORTED
        self.groups = [g for g in self.groups if g is not group]
        self.waiting = [g for g in self.waiting if g is not group]

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def each_block_free_xor_referenced(self):
        if self.bm is None:
            return
        bm = self.bm
        tables = bm.block_tables.values()
        if self.window is None:
            assert not any(NULL_BLOCK in table for table in tables), "null block handed out"
        # A released entry is NULL_BLOCK: the null block, held by nobody.
        refs = Counter(b for table in tables for b in table if b != NULL_BLOCK)
        free, evictable = list(bm.free_block_ids), list(bm.evictable)
        assert 0 not in free and 0 not in evictable, "null block handed out"
        assert len(set(free) | set(evictable)) == len(free) + len(evictable)
        for table in tables:
            live = [b for b in table if b != NULL_BLOCK]
            assert len(set(live)) == len(live)
        free_set = set(free) | set(evictable)
        for block in bm.blocks[1:]:
            assert (block.block_id in free_set) != (refs[block.block_id] > 0)
            assert block.ref_count == refs[block.block_id]
        for block_id in evictable:
            assert bm.hash_to_block_id[bm.blocks[block_id].hash] == block_id
        for h, block_id in bm.hash_to_block_id.items():
            assert bm.blocks[block_id].hash == h
        assert bm.get_num_free_blocks() + len(refs) == bm.num_blocks - 1
        assert bm.get_stats().num_blocks_used == len(refs)

        host_tables = bm.host_block_tables.values()
        host_refs = Counter(b for table in host_tables for b in table if b != HOST_NULL)
        host_free = set(bm.free_host_block_ids)
        assert len(host_free) == len(bm.free_host_block_ids)
        for host_id, ref_count in enumerate(bm.host_ref_counts):
            assert (host_id in host_free) != (host_refs[host_id] > 0)
            assert ref_count == host_refs[host_id]
        assert not set(bm.block_tables) & set(bm.host_block_tables)

    @invariant()
    def tables_hold_the_computed_kv(self):
        if self.bm is None:
            return
        bm, bs = self.bm, self.bs
        fills: dict[int, int] = {}
        for group in self.groups:
            for seq in group.get_seqs():
                if seq.seq_id in bm.block_tables:
                    table, pool = bm.block_tables[seq.seq_id], self.device
                elif seq.seq_id in bm.host_block_tables:
                    table, pool = bm.host_block_tables[seq.seq_id], self.host
                else:
                    assert seq.is_finished()
                    continue
                covered = self.covered[seq.seq_id]
                assert len(table) == -(-covered // bs)
                null = NULL_BLOCK if pool is self.device else HOST_NULL
                freed = [i for i, b in enumerate(table) if b == null]
                # Only blocks the next step cannot read were released; all it can read are there.
                first_live = self.first_live(seq)
                assert all(i < first_live for i in freed), (seq, table)
                for t in range(first_live * bs, seq.num_computed_tokens):
                    assert pool[table[t // bs]][t % bs] == kv_of(seq, t), (seq, t)
                if pool is self.device:
                    for i, block_id in enumerate(table):
                        if block_id == NULL_BLOCK:
                            continue
                        fill = min(bs, covered - i * bs)
                        assert fills.setdefault(block_id, fill) == fill
                        block = bm.blocks[block_id]
                        if block.key is not None and not (i and table[i - 1] == NULL_BLOCK):
                            # a cached block holds exactly its key
                            parent = bm.blocks[table[i - 1]].identity() if i else None
                            tokens = tuple(seq.get_token_ids()[i * bs : (i + 1) * bs])
                            assert block.key == (parent, tokens, seq.extra_hash_key)
        assert bm._num_tokens_stored == sum(fills.values())

    def teardown(self):
        if self.bm is None:
            return
        for group in self.groups:
            for seq in group.get_seqs():
                if self.bm.has_blocks(seq):
                    self.bm.free(seq)
        assert self.bm.get_num_free_blocks() == self.bm.num_blocks - 1, "leaked device blocks"
        assert self.bm.get_num_free_host_blocks() == self.bm.num_host_blocks, "leaked host blocks"
        stats = self.bm.get_stats()
        assert stats.num_blocks_used == 0 and self.bm._num_tokens_stored == 0


class PrefixCachingMachine(BlockManagerMachine):
    enable_prefix_caching = True


class SlidingWindowMachine(BlockManagerMachine):
    """Every layer shares one window: blocks before it are released after each step."""

    enable_prefix_caching = True
    windowed = True


_settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase
TestBlockManagerStateMachine.settings = _settings
TestBlockManagerPrefixCachingStateMachine = PrefixCachingMachine.TestCase
TestBlockManagerPrefixCachingStateMachine.settings = _settings
TestBlockManagerSlidingWindowStateMachine = SlidingWindowMachine.TestCase
TestBlockManagerSlidingWindowStateMachine.settings = _settings
