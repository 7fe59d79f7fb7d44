"""Blocks wholly before a shared sliding window are freed (pure Python: block manager, scheduler,
admission). The model-level check (Mistral against HF in a pool too small for whole sequences) is
in tests/models/test_families.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

from pagedjax.config import SchedulerConfig
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.block_swap import NULL_BLOCK
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedjax.core.window import first_live_block, live_blocks, shared_window
from pagedjax.engine.input_processor import Capacity, InputProcessor, check_capacity
from pagedjax.sampling_params import SamplingParams


@pytest.mark.parametrize("window", [1, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_first_live_block_is_the_hf_window_boundary(window, block_size):
    """Brute force over positions: the query at p reads keys in (p - window, p]; a block may be
    freed iff none of its positions is read by a query at num_computed or later."""
    for num_computed in range(40):
        read = set(range(max(0, num_computed - window + 1), num_computed + 1))
        freeable = 0
        while all(t < num_computed and t not in read for t in _positions(freeable, block_size)):
            freeable += 1
        assert first_live_block(num_computed, window, block_size) == freeable


def _positions(block: int, block_size: int) -> range:
    return range(block * block_size, (block + 1) * block_size)


def test_shared_window_only_when_every_layer_slides_alike():
    assert shared_window([8, 8, 8]) == 8
    assert shared_window([8, 0, 8]) is None  # Gemma-style local/global: one table, nothing freed
    assert shared_window([8, 16]) is None
    assert shared_window([0, 0]) is None


def _group(rid: str, seq_id: int, prompt: list[int], max_tokens: int, block_size: int):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(rid, [Sequence(seq_id, prompt, block_size)], float(seq_id), params)


def _run(sched: Scheduler, bm: BlockManager, groups, poison: dict, rng) -> int:
    """Drive the scheduler with a fake model: each computed token's KV is (seq_id, position),
    written into a simulated pool; freed blocks are NaN-poisoned. Every step, each query reads
    its window through its block table and must see exactly its own keys. Returns the most
    blocks any one sequence held."""
    bs = bm.block_size
    pool = {b: [None] * bs for b in range(bm.num_blocks)}
    host = {h: [None] * bs for h in range(bm.num_host_blocks)}
    peak = 0
    while sched.has_unfinished():
        out = sched.schedule()
        for src, dst in out.blocks_to_swap_out:
            host[dst] = list(pool[src])
        for src, dst in out.blocks_to_swap_in:
            pool[dst] = list(host[src])
        for src, dst in out.blocks_to_copy:
            pool[dst] = list(pool[src])
        for b in set(range(1, bm.num_blocks)) - {x for t in bm.block_tables.values() for x in t}:
            pool[b] = [np.nan] * bs  # free (or freed and later reused): poison it
        rows = 0
        for c in out.chunks:
            table = bm.get_block_table(c.seq)
            peak = max(peak, sum(b != NULL_BLOCK for b in table))
            start = c.seq.num_computed_tokens
            for p in range(start, start + c.num_tokens):
                block = table[p // bs]
                assert block != NULL_BLOCK
                pool[block][p % bs] = (c.seq.seq_id, p)
            for p in range(start, start + c.num_tokens):  # the window of each query
                for k in range(max(0, p - poison["window"] + 1), p + 1):
                    assert pool[table[k // bs]][k % bs] == (c.seq.seq_id, k), (c.seq, p, k)
            rows += c.num_samples
        result = types.SimpleNamespace(
            tokens=rng.integers(3, 50, rows), logprobs=np.zeros(rows, np.float32)
        )
        sched.update_from_output(out.chunks, result)
        sched.drop_finished()
    return peak


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_long_sequences_run_in_a_pool_smaller_than_one_sequence(mode):
    """window 8, block_size 4: a decode holds at most live_blocks(8, 1, 4) = 3 blocks. Pool: 9
    usable blocks (36 slots); three sequences of 30-token prompts + 20 tokens = 50 tokens each
    (13 blocks each without freeing, 39 in all). They finish, each query reading only its own
    keys (freed blocks are reused and poisoned), and no sequence ever holds more than
    live_blocks(8, chunk, 4) blocks."""
    window, bs = 8, 4
    bm = BlockManager(10, bs, num_host_blocks=16, watermark=0.0, sliding_window=window)
    sched = Scheduler(
        bm, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, preemption_mode=mode)
    )
    assert bm.max_chunk_tokens == 16  # the budget; the pool alone allows 9 * 4 - 8 - 4 + 2 = 26
    rng = np.random.default_rng(0)
    groups = []
    for i in range(3):
        group = _group(f"r{i}", i, rng.integers(3, 50, 30).tolist(), 20, bs)
        sched.add(group)
        groups.append(group)
    peak = _run(sched, bm, groups, {"window": window}, rng)
    assert all(g.get_seqs()[0].get_output_len() == 20 for g in groups)
    assert peak <= live_blocks(window, 16, bs) == 7
    assert sched.num_preemptions > 0
    assert bm.get_num_free_blocks() == 9 and bm.get_stats().num_blocks_used == 0
    if mode == "swap":
        assert bm.get_stats().num_swapped_out > 0
        assert bm.get_num_free_host_blocks() == 16


def test_shared_prompt_blocks_stay_alive_while_a_sibling_holds_them():
    bm = BlockManager(20, 2, watermark=0.0, sliding_window=3)
    parent = Sequence(1, list(range(10)), 2)
    bm.allocate(SequenceGroup("r", [parent], arrival_time=0.0))
    parent.num_computed_tokens = 10
    parent.status = SequenceStatus.RUNNING
    child = parent.fork(2)
    bm.fork(parent, child)
    table = bm.get_block_table(parent)
    assert bm.release_outside_window(parent) == first_live_block(10, 3, 2) == 4
    assert bm.get_block_table(parent)[:4] == [NULL_BLOCK] * 4
    for b in table[:4]:  # still the child's
        assert bm.blocks[b].ref_count == 1
    free_before = bm.get_num_free_blocks()
    assert bm.release_outside_window(child) == 4
    assert bm.get_num_free_blocks() == free_before + 4
    assert bm.release_outside_window(child) == 0  # idempotent


def test_prefix_cache_hits_before_the_window_are_not_held():
    """A prompt whose cached prefix reaches past the window holds only the hits the first step
    reads; the others stay cached for whoever needs them."""
    bm = BlockManager(20, 2, watermark=0.0, enable_prefix_caching=True, sliding_window=3)
    first = Sequence(1, list(range(11)), 2)
    bm.allocate(SequenceGroup("a", [first], arrival_time=0.0))
    first.num_computed_tokens = 11
    bm.mark_blocks_computed(first)
    bm.free(first)
    second = Sequence(2, list(range(11)) + [7], 2)
    bm.allocate(SequenceGroup("b", [second], arrival_time=1.0))
    assert second.num_computed_tokens == 10  # 5 full blocks hit
    table = bm.get_block_table(second)
    live = first_live_block(10, 3, 2)  # 4: positions 8, 9 and the new ones are read
    assert table[:live] == [NULL_BLOCK] * live and NULL_BLOCK not in table[live:]
    assert bm.get_stats().num_blocks_used == len(table) - live


def _capacity(**kw) -> Capacity:
    base = dict(
        max_model_len=4096,
        max_num_seqs=8,
        token_budget=256,
        enable_chunked_prefill=True,
        block_size=16,
        num_blocks=11,
        num_usable_blocks=10,
        num_host_blocks=64,
        vocab_size=100,
        sliding_window=64,
    )
    return Capacity(**{**base, **kw})


def test_admission_counts_the_window_not_the_length():
    """10 usable blocks of 16 (160 slots); window 64: a decode holds live_blocks(64, 1, 16) = 5
    blocks, so a 3000-token prompt with 1000 new tokens is admitted with chunked prefill, and
    refused without it (its one-step prefill would need 250 blocks) or without the window."""
    check_capacity(_capacity())
    InputProcessor(_capacity()).check([1] * 3000, SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="KV blocks"):
        InputProcessor(_capacity(sliding_window=None)).check([1] * 3000, SamplingParams())
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        check_capacity(_capacity(enable_chunked_prefill=False, token_budget=4096))
    with pytest.raises(ValueError, match="KV blocks"):  # n=3 decodes: 15 blocks > 10
        InputProcessor(_capacity()).check([1] * 3000, SamplingParams(n=3, max_tokens=10))


def test_a_window_wider_than_the_pool_keeps_whole_tables():
    """Window 1000 over 10 usable blocks of 16: not even one decode's window fits, so tables
    cover whole sequences as without a window, and admission counts whole sequences."""
    bm = BlockManager(11, 16, watermark=0.0, sliding_window=1000)
    assert bm.max_chunk_tokens >= 2**62
    cap = _capacity(sliding_window=1000)
    InputProcessor(cap).check([1] * 100, SamplingParams(max_tokens=50))  # 10 blocks: fits
    with pytest.raises(ValueError, match="KV blocks"):
        InputProcessor(cap).check([1] * 200, SamplingParams(max_tokens=50))
