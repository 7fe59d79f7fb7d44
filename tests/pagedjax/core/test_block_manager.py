"""Unit tests for the block manager, one operation at a time, and for Sequence/SequenceGroup."""

import itertools

import pytest
from import_checks import assert_imports_no_jax

from pagedjax.core.block_manager import AllocStatus, BlockManager
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4
_ids = itertools.count(1)


def make_group(prompt, n=1, block_size=BS, salt=None):
    seqs = [Sequence(next(_ids), prompt, block_size, extra_hash_key=salt) for _ in range(n)]
    return SequenceGroup(f"req-{seqs[0].seq_id}", seqs, arrival_time=0.0)


def admit(bm, group):
    bm.allocate(group)
    for seq in group.get_seqs(SequenceStatus.WAITING):
        seq.status = SequenceStatus.RUNNING
    return group.get_seqs()


def compute(bm, seq):
    """What the engine does after a step: every token's KV is written, then offered to the cache."""
    seq.num_computed_tokens = seq.get_len()
    bm.mark_blocks_computed(seq)


def decode(bm, seq, token=7):
    """Sample one token and give it a slot, as the next step's schedule does."""
    compute(bm, seq)
    seq.append_token_id(token)
    return bm.append_slots(seq)


def state(bm):
    return (
        list(bm.free_block_ids),
        list(bm.evictable),
        dict(bm.hash_to_block_id),
        {k: list(v) for k, v in bm.block_tables.items()},
        {k: list(v) for k, v in bm.host_block_tables.items()},
        [b.ref_count for b in bm.blocks],
        list(bm.host_ref_counts),
        list(bm.free_host_block_ids),
        bm.get_stats(),
    )


# ---- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=1, block_size=4), "num_blocks"),
        (dict(num_blocks=8, block_size=0), "block_size"),
        (dict(num_blocks=8, block_size=4, num_host_blocks=-1), "num_host_blocks"),
        (dict(num_blocks=8, block_size=4, watermark=1.0), "watermark"),
    ],
)
def test_bad_construction_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


def test_null_block_is_never_handed_out():
    bm = BlockManager(num_blocks=6, block_size=BS, watermark=0.0)
    assert bm.get_num_free_blocks() == 5
    seqs = [admit(bm, make_group([1] * BS))[0] for _ in range(5)]
    tables = [bm.get_block_table(seq) for seq in seqs]
    assert sorted(b for t in tables for b in t) == [1, 2, 3, 4, 5]
    assert bm.get_num_free_blocks() == 0
    assert bm.can_allocate(make_group([1])) is AllocStatus.LATER


# ---- allocate ----------------------------------------------------------------------------------


def test_free_blocks_are_handed_out_lowest_first():
    """A prompt's blocks come out ascending and adjacent whatever order blocks were freed in
    (a CPU reads adjacent pages at about twice the rate of scattered ones)."""
    bm = BlockManager(num_blocks=16, block_size=BS, watermark=0.0)
    (a,) = admit(bm, make_group(list(range(3 * BS))))
    (b,) = admit(bm, make_group(list(range(2 * BS))))
    (c,) = admit(bm, make_group(list(range(3 * BS))))
    assert [bm.get_block_table(s) for s in (a, b, c)] == [[1, 2, 3], [4, 5], [6, 7, 8]]
    bm.free(c)  # freed tail first, as the block manager frees
    bm.free(a)
    (d,) = admit(bm, make_group(list(range(5 * BS))))
    assert bm.get_block_table(d) == [1, 2, 3, 6, 7]
    (e,) = admit(bm, make_group(list(range(2 * BS))))
    assert bm.get_block_table(e) == [8, 9]
    assert list(bm.free_block_ids) == list(range(10, 16))  # iterates ascending


def test_allocate_gives_ceil_len_over_block_size_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    (seq,) = admit(bm, make_group(list(range(9))))
    assert len(bm.get_block_table(seq)) == 3
    assert seq.num_computed_tokens == 0
    assert bm.get_num_free_blocks() == 15 - 3


def test_can_allocate_ok_later_never_with_watermark():
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.2)  # watermark: 2 blocks
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(make_group([0] * (8 * BS))) is AllocStatus.OK  # 10 - 8 >= 2
    assert bm.can_allocate(make_group([0] * (8 * BS + 1))) is AllocStatus.NEVER  # 9 blocks
    admit(bm, make_group([0] * (4 * BS)))
    assert bm.can_allocate(make_group([0] * (4 * BS))) is AllocStatus.OK  # 6 - 4 >= 2
    assert bm.can_allocate(make_group([0] * (5 * BS))) is AllocStatus.LATER  # 6 - 5 < 2


def test_group_shares_the_prompt_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    seqs = admit(bm, make_group([1, 2, 3, 4, 5, 6], n=3))
    tables = [bm.get_block_table(seq) for seq in seqs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
    assert [bm.blocks[b].ref_count for b in tables[0]] == [3, 3]
    assert bm.get_stats().num_blocks_used == 2


def test_group_larger_than_the_pool_is_never_and_allocate_raises_cleanly():
    bm = BlockManager(num_blocks=5, block_size=BS)
    group = make_group([0] * (5 * BS))  # 5 blocks, the pool has 4
    assert bm.can_allocate(group) is AllocStatus.NEVER
    before = state(bm)
    with pytest.raises(ValueError, match=r"needs 5 blocks.*pool's 4"):
        bm.allocate(group)
    assert state(bm) == before


def test_allocate_when_not_enough_free_is_all_or_nothing():
    bm = BlockManager(num_blocks=6, block_size=BS, watermark=0.0)
    admit(bm, make_group([0] * (3 * BS)))
    admit(bm, make_group([1] * (2 * BS), n=2))  # the last 2 blocks, shared
    before = state(bm)
    with pytest.raises(ValueError, match="needs 1 blocks"):
        bm.allocate(make_group([2]))
    assert state(bm) == before


def test_allocate_rejects_bad_groups():
    bm = BlockManager(num_blocks=8, block_size=BS)
    diverged = make_group([1, 2])
    diverged.add(Sequence(next(_ids), [1, 3], BS))
    with pytest.raises(ValueError, match="different tokens"):
        bm.allocate(diverged)
    group = make_group([1, 2])
    admit(bm, group)
    with pytest.raises(ValueError, match="no WAITING"):
        bm.allocate(group)
    with pytest.raises(ValueError, match="block_size"):
        bm.allocate(make_group([1, 2], block_size=BS * 2))
    assert bm.get_stats().num_blocks_used == 1


# ---- append_slots / copy-on-write ----------------------------------------------------------------


def test_append_slots_adds_a_block_only_on_a_boundary():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (seq,) = admit(bm, make_group([1, 2, 3]))
    assert decode(bm, seq) == []  # token 4 fills block 0
    assert len(bm.get_block_table(seq)) == 1
    assert decode(bm, seq) == []  # token 5 starts block 1
    assert len(bm.get_block_table(seq)) == 2


def test_append_to_a_shared_last_block_copies_it_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (parent,) = admit(bm, make_group([1, 2, 3, 4, 5]))
    compute(bm, parent)
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    full, last = bm.get_block_table(parent)
    assert bm.blocks[last].ref_count == 2

    child.append_token_id(9)
    copies = bm.append_slots(child)
    assert len(copies) == 1 and copies[0][0] == last
    dst = copies[0][1]
    assert bm.get_block_table(child) == [full, dst]
    assert bm.blocks[last].ref_count == bm.blocks[dst].ref_count == 1
    assert bm.blocks[full].ref_count == 2  # full blocks stay shared: they are never written

    parent.append_token_id(8)
    assert bm.append_slots(parent) == []  # the last block is its own now
    assert bm.get_block_table(parent) == [full, last]


def test_append_past_a_shared_full_block_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (parent,) = admit(bm, make_group([1, 2, 3, 4]))
    compute(bm, parent)
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    child.append_token_id(5)
    assert bm.append_slots(child) == []
    assert bm.get_block_table(child)[0] == bm.get_block_table(parent)[0]


def test_can_append_slots_counts_new_blocks_and_copies():
    bm = BlockManager(num_blocks=4, block_size=BS, watermark=0.0)
    (a,) = admit(bm, make_group([1] * BS))  # one full block
    (b,) = admit(bm, make_group([2] * (2 * BS - 1)))  # its last block has room
    assert bm.get_num_free_blocks() == 0
    compute(bm, b)
    b.append_token_id(2)
    assert bm.can_append_slots(SequenceGroup("b", [b], 0.0))
    bm.append_slots(b)

    compute(bm, a)
    a.append_token_id(1)
    assert not bm.can_append_slots(SequenceGroup("a", [a], 0.0))  # a new block, none free
    before = state(bm)
    with pytest.raises(ValueError, match="can_append_slots"):
        bm.append_slots(a)
    assert state(bm) == before

    bm.free(b)
    (c,) = admit(bm, make_group([3] * 2))
    child = c.fork(next(_ids))
    bm.fork(c, child)
    compute(bm, child)
    child.append_token_id(3)
    group = SequenceGroup("c", [child], 0.0)
    child.status = SequenceStatus.RUNNING
    assert bm.get_num_free_blocks() == 1 and bm.can_append_slots(group)  # one copy
    bm.free(a)
    admit(bm, make_group([4] * (2 * BS)))
    assert bm.get_num_free_blocks() == 0
    assert not bm.can_append_slots(group)  # the copy needs a free block


def test_append_to_finished_or_unknown_seq_raises_without_side_effects():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (seq,) = admit(bm, make_group([1, 2]))
    seq.status = SequenceStatus.FINISHED_STOPPED
    before = state(bm)
    with pytest.raises(ValueError, match="FINISHED_STOPPED"):
        bm.append_slots(seq)
    with pytest.raises(ValueError, match="seq_id 12345"):
        bm.append_slots(Sequence(12345, [1], BS))
    assert state(bm) == before


def test_num_computed_tokens_beyond_the_table_is_rejected():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (seq,) = admit(bm, make_group([1, 2]))
    seq.num_computed_tokens = 3
    with pytest.raises(ValueError, match="num_computed_tokens 3"):
        bm.append_slots(seq)


# ---- fork / free / get_block_table ---------------------------------------------------------------


def test_fork_shares_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (parent,) = admit(bm, make_group(list(range(10))))
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert all(bm.blocks[b].ref_count == 2 for b in bm.get_block_table(parent))
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.fork(parent, child)


def test_free_returns_blocks_only_when_the_last_holder_goes():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (parent,) = admit(bm, make_group(list(range(6))))
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    bm.free(parent)
    assert bm.get_num_free_blocks() == 7 - 2
    bm.free(child)
    assert bm.get_num_free_blocks() == 7
    assert bm.get_stats().num_blocks_used == 0


def test_free_unknown_sequence_raises_and_names_it():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (seq,) = admit(bm, make_group([1]))
    before = state(bm)
    with pytest.raises(ValueError, match="seq_id 424242"):
        bm.free(Sequence(424242, [1], BS))
    assert state(bm) == before
    bm.free(seq)
    with pytest.raises(ValueError, match=f"seq_id {seq.seq_id}"):
        bm.free(seq)  # twice


def test_get_block_table_is_a_copy():
    bm = BlockManager(num_blocks=8, block_size=BS)
    (seq,) = admit(bm, make_group([1, 2, 3, 4, 5]))
    table = bm.get_block_table(seq)
    table.append(0)
    assert len(bm.get_block_table(seq)) == 2


# ---- swap ----------------------------------------------------------------------------------------


def test_swap_out_and_in_move_shared_blocks_once():
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=4, watermark=0.0)
    group = make_group([1, 2, 3, 4, 5])
    (parent,) = admit(bm, group)
    compute(bm, parent)
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    group.add(child)
    child.append_token_id(6)
    bm.append_slots(child)  # child: [shared full block, own copy of the last]
    device_blocks = {b for s in (parent, child) for b in bm.get_block_table(s)}
    assert len(device_blocks) == 3

    assert bm.can_swap_out(group)
    out = bm.swap_out(group)
    assert len(out) == 3 and {d for d, _ in out} == device_blocks
    assert bm.get_num_free_blocks() == 7 and bm.get_num_free_host_blocks() == 1
    shared_host = bm.host_block_tables[parent.seq_id][0]
    assert bm.host_block_tables[child.seq_id][0] == shared_host
    assert bm.host_ref_counts[shared_host] == 2
    with pytest.raises(ValueError, match="no device block table"):
        bm.get_block_table(parent)

    assert bm.can_swap_in(group) is AllocStatus.OK
    back = bm.swap_in(group)
    assert len(back) == 3 and {h for h, _ in back} == {h for _, h in out}
    shared = bm.get_block_table(parent)[0]
    assert bm.get_block_table(child)[0] == shared and bm.blocks[shared].ref_count == 2
    assert bm.get_num_free_host_blocks() == 4
    stats = bm.get_stats()
    assert stats.num_swapped_out == stats.num_swapped_in == 3


def test_swap_out_without_host_room_raises_cleanly():
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=1)
    group = make_group(list(range(6)))
    admit(bm, group)
    assert not bm.can_swap_out(group)
    before = state(bm)
    with pytest.raises(ValueError, match="needs 2 host blocks"):
        bm.swap_out(group)
    assert state(bm) == before


def test_can_swap_in_never_later_ok():
    bm = BlockManager(num_blocks=5, block_size=BS, num_host_blocks=8, watermark=0.0)
    big = make_group([0] * (4 * BS))
    (seq,) = admit(bm, big)
    bm.swap_out(big)
    assert bm.can_swap_in(big) is AllocStatus.OK  # exact: its 4 blocks hold every token
    seq.append_token_id(7)
    assert bm.can_swap_in(big) is AllocStatus.NEVER  # 4 blocks + 1 to grow > 4
    small = make_group([0] * BS)
    admit(bm, small)
    bm.swap_out(small)
    assert bm.can_swap_in(small) is AllocStatus.OK
    admit(bm, make_group([1] * (4 * BS)))  # the whole pool
    assert bm.can_swap_in(small) is AllocStatus.LATER
    with pytest.raises(ValueError, match="no host blocks"):
        bm.swap_in(make_group([1]))


def test_free_a_swapped_sequence_releases_host_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    group = make_group(list(range(6)))
    (seq,) = admit(bm, group)
    bm.swap_out(group)
    bm.free(seq)
    assert bm.get_num_free_host_blocks() == 4 and bm.get_num_free_blocks() == 7


# ---- prefix caching ------------------------------------------------------------------------------


def test_prefix_cache_reuses_computed_leading_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    (a,) = admit(bm, make_group(list(range(10))))
    compute(bm, a)
    (b,) = admit(bm, make_group(list(range(8)) + [99, 98, 97]))
    assert b.num_computed_tokens == 2 * BS
    assert bm.get_block_table(b)[:2] == bm.get_block_table(a)[:2]
    assert bm.get_block_table(b)[2] != bm.get_block_table(a)[2]
    assert bm.blocks[bm.get_block_table(a)[0]].ref_count == 2
    stats = bm.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 + 2, 2)
    assert stats.prefix_cache_hit_rate == 0.5


def test_prefix_cache_never_covers_the_last_prompt_token():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    (a,) = admit(bm, make_group(list(range(2 * BS))))
    compute(bm, a)
    (b,) = admit(bm, make_group(list(range(2 * BS))))  # the same prompt, two full blocks
    assert b.num_computed_tokens == BS  # the last block is computed again
    assert bm.get_block_table(b)[0] == bm.get_block_table(a)[0]
    assert bm.get_block_table(b)[1] != bm.get_block_table(a)[1]


def test_uncomputed_full_blocks_are_not_hits():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    (a,) = admit(bm, make_group(list(range(3 * BS))))
    (b,) = admit(bm, make_group(list(range(3 * BS))))
    assert b.num_computed_tokens == 0  # a's blocks are full but not computed
    a.num_computed_tokens = BS + 2  # chunked prefill: one block and a bit
    bm.mark_blocks_computed(a)
    (c,) = admit(bm, make_group(list(range(3 * BS))))
    assert c.num_computed_tokens == BS
    assert bm.get_block_table(c)[0] == bm.get_block_table(a)[0]


def test_freed_cached_blocks_stay_reusable():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    (a,) = admit(bm, make_group(list(range(9))))
    compute(bm, a)
    cached = bm.get_block_table(a)[:2]
    bm.free(a)
    assert bm.get_num_free_blocks() == 15 and bm.get_stats().num_blocks_used == 0
    (b,) = admit(bm, make_group(list(range(9))))
    assert bm.get_block_table(b)[:2] == cached and b.num_computed_tokens == 2 * BS


def test_eviction_takes_pristine_blocks_first_then_least_recently_used():
    bm = BlockManager(num_blocks=5, block_size=BS, watermark=0.0, enable_prefix_caching=True)
    (a,) = admit(bm, make_group([1] * BS + [9]))
    compute(bm, a)
    (b,) = admit(bm, make_group([2] * BS + [9]))
    compute(bm, b)
    a_block, b_block = bm.get_block_table(a)[0], bm.get_block_table(b)[0]
    bm.free(a)  # a's prefix cached, least recently used
    bm.free(b)
    assert list(bm.evictable) == [a_block, b_block]
    (c,) = admit(bm, make_group([3] * BS + [9]))  # 2 pristine blocks: nothing evicted
    assert list(bm.evictable) == [a_block, b_block]
    compute(bm, c)
    bm.free(c)
    (d,) = admit(bm, make_group([4] * (2 * BS)))  # c's pristine tail, then the LRU: a's
    assert a_block in bm.get_block_table(d) and b_block not in bm.get_block_table(d)
    bm.free(d)  # never computed: back to the pristine blocks
    (e,) = admit(bm, make_group([1] * BS + [9]))  # a's prefix is gone
    assert e.num_computed_tokens == 0
    (f,) = admit(bm, make_group([2] * BS + [9]))  # b's is still there
    assert f.num_computed_tokens == BS and bm.get_block_table(f)[0] == b_block


def test_referenced_cached_blocks_are_not_evictable():
    bm = BlockManager(num_blocks=4, block_size=BS, watermark=0.0, enable_prefix_caching=True)
    (a,) = admit(bm, make_group([1] * BS + [9]))
    compute(bm, a)
    assert not bm.evictable and bm.get_num_free_blocks() == 1
    bm.free(a)
    (b,) = admit(bm, make_group([1] * BS + [8]))  # revives a's first block
    assert b.num_computed_tokens == BS and not bm.evictable
    assert bm.can_allocate(make_group([5] * (2 * BS))) is AllocStatus.LATER


def test_hash_collision_is_never_a_hit():
    bm = BlockManager(
        num_blocks=16,
        block_size=BS,
        enable_prefix_caching=True,
        hash_fn=lambda parent_hash, token_ids, extra_key: 42,  # every block collides
    )
    (a,) = admit(bm, make_group([1, 2, 3, 4, 5]))
    compute(bm, a)
    (b,) = admit(bm, make_group([1, 2, 3, 5, 5]))  # same hash, other tokens
    assert b.num_computed_tokens == 0
    assert bm.get_block_table(b)[0] != bm.get_block_table(a)[0]
    (c,) = admit(bm, make_group([1, 2, 3, 4, 6]))  # same hash, same tokens: a true hit
    assert c.num_computed_tokens == BS


def test_hash_collision_with_another_prefix_is_never_a_hit():
    """Same block tokens after a different prefix must miss, even when the hashes collide."""
    bm = BlockManager(
        num_blocks=16,
        block_size=BS,
        enable_prefix_caching=True,
        hash_fn=lambda parent_hash, token_ids, extra_key: hash(token_ids),  # ignores the prefix
    )
    (a,) = admit(bm, make_group([1] * BS + [2] * BS + [0]))
    compute(bm, a)
    (b,) = admit(bm, make_group([2] * BS + [2] * BS + [0]))
    assert b.num_computed_tokens == 0


@pytest.mark.parametrize(
    "hash_fn",
    [
        None,
        lambda parent_hash, token_ids, extra_key: hash((parent_hash, token_ids)),  # collides
    ],
)
def test_extra_hash_key_separates_tenants(hash_fn):
    kwargs = {"hash_fn": hash_fn} if hash_fn else {}
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True, **kwargs)
    (a,) = admit(bm, make_group(list(range(9)), salt="tenant-a"))
    compute(bm, a)
    (b,) = admit(bm, make_group(list(range(9)), salt="tenant-b"))
    (c,) = admit(bm, make_group(list(range(9)), salt="tenant-a"))
    assert b.num_computed_tokens == 0 and c.num_computed_tokens == 2 * BS


def test_blocks_swapped_back_in_are_cached_again_once_marked():
    bm = BlockManager(num_blocks=16, block_size=BS, num_host_blocks=8, enable_prefix_caching=True)
    group = make_group(list(range(9)))
    (a,) = admit(bm, group)
    compute(bm, a)
    bm.swap_out(group)
    bm.hash_to_block_id.clear()  # as if the device copies had been evicted
    for block_id in list(bm.evictable):
        bm.evictable.pop(block_id)
        bm.blocks[block_id].hash = bm.blocks[block_id].key = None  # as eviction leaves it
        bm.free_block_ids.append(block_id)
    bm.swap_in(group)
    bm.mark_blocks_computed(a)
    (b,) = admit(bm, make_group(list(range(9))))
    assert b.num_computed_tokens == 2 * BS
    assert bm.get_block_table(b)[:2] == bm.get_block_table(a)[:2]


def test_without_prefix_caching_nothing_is_shared_across_requests():
    bm = BlockManager(num_blocks=16, block_size=BS)
    (a,) = admit(bm, make_group(list(range(9))))
    compute(bm, a)
    (b,) = admit(bm, make_group(list(range(9))))
    assert b.num_computed_tokens == 0
    assert not set(bm.get_block_table(a)) & set(bm.get_block_table(b))
    assert bm.get_stats().prefix_cache_queries == 0


# ---- accounting ----------------------------------------------------------------------------------


def test_stats_count_used_peak_and_utilisation():
    bm = BlockManager(num_blocks=16, block_size=BS)
    (a,) = admit(bm, make_group([1] * 5))  # 2 blocks, 5 tokens
    (b,) = admit(bm, make_group([1] * 4))  # 1 block, 4 tokens
    bm.record_usage()  # 9 tokens in 12 slots
    bm.free(b)
    bm.record_usage()  # 5 tokens in 8 slots
    stats = bm.get_stats()
    assert stats.num_blocks_total == 15
    assert stats.num_blocks_used == 2 and stats.num_blocks_peak == 3
    assert stats.kv_slots_allocated_peak == 12 and stats.kv_tokens_stored_peak == 9
    assert stats.kv_utilization == pytest.approx((9 + 5) / (12 + 8))


def test_a_shared_block_counts_its_tokens_once():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, make_group([1] * 6, n=3))
    bm.record_usage()
    assert bm.get_stats().kv_utilization == pytest.approx(6 / 8)
    assert bm.get_stats().kv_tokens_stored_peak == 6


def test_utilisation_is_zero_before_any_sample():
    assert BlockManager(num_blocks=4, block_size=BS).get_stats().kv_utilization == 0.0


# ---- Sequence / SequenceGroup --------------------------------------------------------------------


def test_sequence_tokens_and_fork_are_independent():
    seq = Sequence(1, [5, 6, 7], block_size=2)
    seq.append_token_id(8, logprob=-0.5)
    assert seq.get_token_ids() == [5, 6, 7, 8] and seq.get_len() == 4
    assert seq.get_prompt_len() == 3 and seq.get_output_len() == 1 and seq.num_blocks == 2
    assert seq.cumulative_logprob == -0.5 and seq.get_last_token_id() == 8
    child = seq.fork(2)
    child.append_token_id(9, logprob=-1.0)
    assert seq.get_token_ids() == [5, 6, 7, 8] and seq.output_token_ids == [8]
    assert child.get_token_ids() == [5, 6, 7, 8, 9] and child.cumulative_logprob == -1.5
    assert child.seq_id == 2 and child.prompt_token_ids == [5, 6, 7]


def test_sequence_status_and_group_queries():
    assert not SequenceStatus.RUNNING.is_finished()
    assert SequenceStatus.FINISHED_ABORTED.is_finished()
    a, b = Sequence(1, [1], 4), Sequence(2, [1], 4)
    group = SequenceGroup("r", [a, b], arrival_time=1.0, sampling_params=object())
    b.status = SequenceStatus.RUNNING
    assert group.get_seqs(SequenceStatus.RUNNING) == [b] and group.num_seqs() == 2
    assert group.num_seqs(SequenceStatus.WAITING) == 1 and not group.is_finished()
    a.status = b.status = SequenceStatus.FINISHED_STOPPED
    assert group.is_finished()
    with pytest.raises(ValueError, match="seq_id 1"):
        group.add(Sequence(1, [1], 4))


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        Sequence(1, [], 4)


# ---- no jax --------------------------------------------------------------------------------------


def test_core_and_utilisation_bench_import_no_jax():
    assert_imports_no_jax(
        "pagedjax.core.sequence",
        "pagedjax.core.block_manager",
        "pagedjax.core.scheduler",
        "pagedjax.bench.block_utilization",
    )
