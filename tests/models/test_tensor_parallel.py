"""Tensor parallelism by heads on 4 virtual CPU devices (in a subprocess: XLA_FLAGS)."""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_report import run_reporting_worker

WORKER = Path(__file__).with_name("tp_worker.py")


def run_worker(tmp: Path, flag: str) -> dict:
    return run_reporting_worker([str(WORKER), str(tmp), flag], num_devices=4, timeout=1200)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("tp"), "--smollm")


@pytest.fixture(scope="module")
def family_report(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("tp_families"), "--families")


def test_tiny_llama_tp_2_and_4_match_tp_1(report):
    tiny = report["tiny"]
    assert tiny["2"]["tokens"] == tiny["1"]["tokens"]
    assert tiny["4"]["tokens"] == tiny["1"]["tokens"]  # 4 > 2 KV heads: replicated


def test_smollm_tp_3_matches_and_tp_2_is_refused(report):
    smol = report["smollm"]
    assert smol["3"]["tokens"] == smol["1"]["tokens"]
    assert "num_heads=9" in smol["2"]["error"]


@pytest.mark.parametrize("model, tp", [("tiny", "2"), ("tiny", "4"), ("smollm", "3")])
def test_each_device_holds_a_slice(report, model, tp):
    entry, k = report[model][tp], int(tp)
    on_device, total = entry["kv_bytes"]
    assert on_device * k == total  # the pool is split evenly by kv heads
    # Attention and MLP weights are split k ways, embedding and LM head by vocabulary; norms
    # (and the biases added after a row-parallel sum) are replicated.
    for name, (on_device, total) in entry["params"].items():
        replicated = "norm" in name or name.endswith(("o_proj/bias", "down_proj/bias"))
        assert on_device * (1 if replicated else k) == total, name
    on_device, total = entry["param_bytes"]
    print(f"{model} tp={k}: {on_device / total:.3f} of the parameter bytes on each device")


@pytest.mark.parametrize("model, tp", [("tiny", "2"), ("tiny", "4"), ("smollm", "3")])
def test_step_never_gathers_the_kv_pool_or_the_embedding(report, model, tp):
    entry = report[model][tp]
    assert entry["all_gathers_of_pool"] == []
    assert all(entry["embedding_tables_split"])  # by vocabulary: embedding (and LM head)
    assert entry["all_gathers_of_embedding"] == []  # vocab-split lookup: masked, then summed
    assert entry["num_all_reduces"] > 0  # row-parallel projections are summed across devices


def test_cached_params_restore_straight_into_the_sharded_layout(report):
    restored = report["sharded_restore"]
    assert restored["shape"] == [2, 64, 64]  # stacked: [num_layers, hidden, heads * head_dim]
    assert restored["shards"] == [[2, 64, 32], [2, 64, 32]]  # each device: its heads' columns


def test_a_split_cache_restores_onto_one_device_without_a_mesh(report):
    assert report["restore_without_mesh_devices"] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "qwen2_moe"])
def test_families_tp_2_matches_tp_1(family_report, name):
    entry = family_report[name]
    assert entry["2"]["tokens"] == entry["1"]["tokens"]
    assert entry["2"]["all_gathers_of_pool"] == []
    assert entry["2"]["all_gathers_of_embedding"] == []


@pytest.mark.slow
def test_experts_are_split_by_their_intermediate_dimension(family_report):
    params = family_report["qwen2_moe"]["2"]["params"]
    experts = [name for name in params if name.startswith("moe/experts/")]
    assert sorted(experts) == [f"moe/experts/{p}_proj" for p in ("down", "gate", "up")]
    for name, (on_device, total) in params.items():
        # The router and the shared expert's gate (one column) are replicated; every expert,
        # the shared expert and the dense layer's MLP are split in two.
        replicated = "norm" in name or name.endswith(("router/kernel", "shared_expert_gate/kernel"))
        assert on_device * (1 if replicated else 2) == total, name
