"""Block-table rows kept across steps (worker/persistent_batch.py): the step input is the stateless
build's, entry for entry, whatever happens to the tables between steps, and a decode step writes
only what changed."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.worker.input_batch import InputBatcher, ScheduledSeq
from pagedjax.worker.persistent_batch import PersistentBatch
from pagedjax.worker.sampler import SamplingRow

BLOCK, MAX_LEN = 4, 64


def _assert_same(a, b):
    for name in ("token_ids", "positions", "slot_mapping", "block_tables", "context_lens",
                 "query_start_loc", "logits_indices"):  # fmt: skip
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.max_query_len == b.max_query_len


def _decode(seq_id: int, table: list[int], ctx: int) -> ScheduledSeq:
    return ScheduledSeq([7 + seq_id], ctx - 1, list(table), [SamplingRow()], seq_id=seq_id)


def test_random_steps_give_the_stateless_step_input():
    rng = np.random.default_rng(0)
    batcher = InputBatcher(BLOCK, MAX_LEN)
    rows = PersistentBatch(6, batcher.max_blocks_per_seq)  # fewer rows than ids: eviction
    tables: dict[int, list[int]] = {}
    lens: dict[int, int] = {}
    next_block = iter(range(1, 10**6))
    for _ in range(300):
        ids = sorted(rng.choice(10, size=int(rng.integers(1, 4)), replace=False).tolist())
        rng.shuffle(ids)  # the step's order is not the rows' order
        seqs = []
        for i in ids:
            table, n = tables.setdefault(i, []), lens.get(i, 0)
            event = rng.integers(6)
            if event == 0 and table:  # copy-on-write of some block
                table[int(rng.integers(len(table)))] = next(next_block)
            elif event == 1 and len(table) > 1:  # preempted and restarted shorter
                del table[int(rng.integers(1, len(table))) :]
                n = min(n, len(table) * BLOCK - 1)
            q = int(rng.integers(1, 4)) if rng.random() < 0.3 else 1
            n = min(n + q, MAX_LEN - 1)
            q = min(q, n)
            while len(table) * BLOCK < n:
                table.append(next(next_block))
            lens[i] = n
            seqs.append(ScheduledSeq(list(range(q)), n - q, list(table), [SamplingRow()],
                                     seq_id=i))  # fmt: skip
        _assert_same(batcher.build(seqs, rows), batcher.build(seqs))
    assert rows.num_held <= 6


def test_a_decode_step_writes_only_what_changed():
    batcher = InputBatcher(BLOCK, MAX_LEN)
    rows = PersistentBatch(8, batcher.max_blocks_per_seq)
    tables = {i: [10 * i + 1, 10 * i + 2] for i in range(3)}
    step = lambda ctx: [_decode(i, tables[i], ctx) for i in range(3)]  # noqa: E731
    batcher.build(step(6), rows)
    assert rows.entries_written == 6  # three new rows, two blocks each
    batcher.build(step(7), rows)
    assert rows.entries_written == 6  # the tables did not change: nothing written
    tables[1].append(13)
    _assert_same(batcher.build(step(9), rows), batcher.build(step(9)))
    assert rows.entries_written == 7  # one block added: one entry
    tables[2][0] = 99  # copy-on-write: the row is written again
    _assert_same(batcher.build(step(9), rows), batcher.build(step(9)))
    assert rows.entries_written == 9


def test_sequences_without_ids_or_repeated_ids_take_the_stateless_path():
    batcher = InputBatcher(BLOCK, MAX_LEN)
    rows = PersistentBatch(4, batcher.max_blocks_per_seq)
    plain = [ScheduledSeq([1], 3, [5], [SamplingRow()]), _decode(1, [6], 4)]
    _assert_same(batcher.build(plain, rows), batcher.build(plain))
    twice = [_decode(1, [6], 4), _decode(1, [8], 4)]
    _assert_same(batcher.build(twice, rows), batcher.build(twice))
    assert rows.entries_written == 0


def test_a_step_wider_than_the_rows_is_refused():
    rows = PersistentBatch(2, 4)
    with pytest.raises(ValueError, match="3 sequences"):
        rows.rows_for([1, 2, 3], [[1], [2], [3]])
    with pytest.raises(ValueError, match="max_rows"):
        PersistentBatch(0, 4)
