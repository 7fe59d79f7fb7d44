"""The ShareGPT-like workload is deterministic, and paged blocks of 16 store >= 0.97 tokens per
slot allocated on it (a deterministic count, not a timing)."""

import pytest

from pagedjax.bench.block_utilization import main, simulate_contiguous, simulate_paged
from pagedjax.bench.workload import sharegpt_like


def test_workload_is_deterministic_per_seed_and_fits_max_model_len():
    a = sharegpt_like(500, max_model_len=1024, seed=3)
    assert a == sharegpt_like(500, max_model_len=1024, seed=3)
    assert a != sharegpt_like(500, max_model_len=1024, seed=4)
    assert len(a) == 500
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in a)
    assert all(r.prompt_len + r.output_len <= 1024 for r in a)
    assert len({r.prompt_len for r in a}) > 100  # a spread, not a constant


def test_workload_lengths_are_sharegpt_like():
    w = sharegpt_like(20_000, max_model_len=4096, seed=0)
    prompt_mean = sum(r.prompt_len for r in w) / len(w)
    output_mean = sum(r.output_len for r in w) / len(w)
    assert 140 < prompt_mean < 180 and 300 < output_mean < 370


def test_workload_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_model_len"):
        sharegpt_like(3, max_model_len=1)
    with pytest.raises(ValueError, match="num_requests"):
        sharegpt_like(-1)


def test_paged_utilisation_at_block_16_beats_097_and_the_contiguous_baseline():
    workload = sharegpt_like(200, max_model_len=2048, seed=0)
    paged = simulate_paged(workload, block_size=16, num_blocks=1024)
    contiguous = simulate_contiguous(workload, max_model_len=2048, num_slots=1023 * 16)
    assert paged.kv_utilization >= 0.97
    assert contiguous.kv_utilization < 0.5
    assert paged.max_concurrent > 4 * contiguous.max_concurrent


def test_benchmark_command_prints_both_columns(capsys):
    main(["--num-requests", "20", "--num-blocks", "256", "--max-model-len", "512"])
    out = capsys.readouterr().out
    assert "paged (block 16)" in out and "contiguous (512)" in out
    assert "tokens stored / slots allocated" in out
