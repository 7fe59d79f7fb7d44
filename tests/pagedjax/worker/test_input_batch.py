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


def test_count_padding_names_the_kind_and_counts_attention_work():
    from pagedjax.inspection.step_profile import StepProfile
    from pagedjax.worker.input_batch import count_padding

    batcher = InputBatcher(block_size=4, max_model_len=64)
    prefill = ScheduledSeq(token_ids=[1, 2, 3], start_pos=2, block_table=[1, 2])
    decode = ScheduledSeq(token_ids=[4], start_pos=6, block_table=[3, 4])
    # real attention work: row i of a chunk sees start_pos + i + 1 keys
    real = {"prefill": 3 + 4 + 5, "mixed": 3 + 4 + 5 + 7, "decode": 7 + 7}
    for kind, seqs in (
        ("prefill", [prefill]),
        ("mixed", [prefill, decode]),
        ("decode", [decode, decode]),
    ):
        step = batcher.build(seqs)
        for rows_only in (False, True):
            profile = StepProfile()
            assert count_padding(profile, seqs, step, 4, rows_only) == kind
            k = profile.kinds[kind]
            assert (k.steps, k.real_tokens, k.real_attention) == (
                1,
                sum(len(s.token_ids) for s in seqs),
                real[kind],
            )
            if rows_only:  # the native kernel reads each row's own keys only
                assert k.padded_attention == k.real_attention
            else:  # the padded shape: every (bucketed) row over the whole table width
                width = step.block_tables.shape[1] * 4
                assert k.padded_attention > k.real_attention
                assert k.padded_attention % width == 0


def test_profile_device_time_falls_to_the_step_kind():
    from pagedjax.inspection.step_profile import StepProfile

    profile = StepProfile()
    with profile.phase("device", "decode"):  # off: nothing is timed
        pass
    assert profile.kinds == {} and profile.seconds["device"] == 0.0
    profile.enabled = True
    for kind in ("decode", "prefill", "decode"):
        with profile.phase("device", kind):
            pass
    with profile.phase("fetch"):
        pass
    assert set(profile.kinds) == {"decode", "prefill"}
    total = sum(k.device_seconds for k in profile.kinds.values())
    assert total == pytest.approx(profile.seconds["device"]) and total > 0
