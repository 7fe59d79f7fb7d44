"""InputBatcher.build packs random batches exactly as the per-sequence definition says."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.worker.input_batch import InputBatcher, ScheduledSeq


def _expected(seqs: list[ScheduledSeq], step, block_size: int) -> dict[str, np.ndarray]:
    """Row by row: sequence i's tokens sit at rows qsl[i]..qsl[i+1], at positions from its start,
    in the slots its block table gives; padding rows have slot -1."""
    out = {
        "token_ids": np.zeros_like(step.token_ids),
        "positions": np.zeros_like(step.positions),
        "slot_mapping": np.full_like(step.slot_mapping, -1),
        "block_tables": np.zeros_like(step.block_tables),
        "context_lens": np.zeros_like(step.context_lens),
        "logits_indices": np.zeros_like(step.logits_indices),
    }
    row = 0
    for i, s in enumerate(seqs):
        out["block_tables"][i, : len(s.block_table)] = s.block_table
        for j, token in enumerate(s.token_ids):
            p = s.start_pos + j
            out["token_ids"][row] = token
            out["positions"][row] = p
            out["slot_mapping"][row] = s.block_table[p // block_size] * block_size + p % block_size
            row += 1
        out["context_lens"][i] = s.start_pos + len(s.token_ids)
        out["logits_indices"][i] = row - 1
    return out


@pytest.mark.parametrize("seed", range(40))
def test_build_matches_the_per_sequence_definition(seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([8, 16]))
    batcher = InputBatcher(bs, 512)
    decode = seed % 3 == 0
    seqs = []
    for _ in range(int(rng.integers(1, 20))):
        q = 1 if decode else int(rng.integers(1, 40))
        start = int(rng.integers(0, 400))
        need = -(-(start + q) // bs)
        table = rng.integers(1, 1000, need + int(rng.integers(0, 2))).tolist()
        seqs.append(ScheduledSeq(rng.integers(0, 100, q).tolist(), start, table))
    step = batcher.build(seqs)
    for name, want in _expected(seqs, step, bs).items():
        np.testing.assert_array_equal(getattr(step, name), want, err_msg=name)
    qsl = step.query_start_loc
    lens = [len(s.token_ids) for s in seqs]
    assert qsl[: len(seqs) + 1].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    if decode:  # padding sequences own the padding rows
        assert qsl.tolist() == list(range(len(qsl)))
        assert step.max_query_len == 1
    else:  # padding sequences own no rows
        assert set(qsl[len(seqs) :].tolist()) == {sum(lens)}
        assert step.max_query_len >= max(lens)
