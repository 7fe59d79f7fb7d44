"""The bench commands run end to end on a tiny random-weight model (timings meaningless here)."""

from __future__ import annotations

import json

import pytest
from hf_models import make_tiny_model

from pagedjax.entrypoints.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_tiny")
    make_tiny_model("llama_gqa", path, max_position_embeddings=1024)
    return str(path)


def _run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_throughput_runs_both_sides(tiny, capsys):
    res = _run_json(
        capsys,
        [
            "bench",
            "throughput",
            "--model",
            tiny,
            "--num-requests",
            "4",
            "--max-prompt-len",
            "16",
            "--max-output-len",
            "6",
            "--hf-batch-sizes",
            "2,4",
            "--hf-sweep-output-len",
            "3",
            "--json",
        ],
    )
    assert res["num_requests"] == 4 and res["max_output_len"] == 6
    assert [r["batch_size"] for r in res["transformers_sweep"]] == [2, 4]
    assert res["transformers"]["batch_size"] in (2, 4)
    assert res["pagedjax"]["output_tokens_per_s"] > 0
    assert res["output_tokens_per_s_ratio"] == pytest.approx(
        res["pagedjax"]["output_tokens_per_s"] / res["transformers"]["output_tokens_per_s"]
    )


def test_throughput_reads_a_dataset_and_prints_a_table(tiny, tmp_path, capsys):
    data = tmp_path / "requests.json"
    data.write_text(
        json.dumps([{"prompt": [5, 6, 7], "output_len": 3}, {"prompt": [9, 10], "output_len": 5}])
    )
    argv = [
        "bench",
        "throughput",
        "--model",
        tiny,
        "--dataset",
        str(data),
        "--skip-hf",
        "--no-warmup",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "workload: 2 requests" in out and "pagedjax" in out


def test_latency_reports_percentiles(tiny, capsys):
    res = _run_json(
        capsys,
        [
            "bench",
            "latency",
            "--model",
            tiny,
            "--num-requests",
            "5",
            "--request-rate",
            "50",
            "--max-prompt-len",
            "16",
            "--max-output-len",
            "5",
            "--json",
        ],
    )
    assert res["num_requests"] == 5 and res["compilations_while_timed"] >= 0
    for key in ("ttft", "tpot", "itl"):
        assert res[key]["p50_ms"] > 0 and res[key]["p99_ms"] >= res[key]["p50_ms"]


# The sharing part decodes about a dozen runs; notebook 02 runs it too, and the engine tests check
# block sharing itself, so its assertions run with the slow tests.
@pytest.mark.parametrize(
    "parts", ["utilization,swap", pytest.param("utilization,sharing,swap", marks=pytest.mark.slow)]
)
def test_memory_utilization_sharing_and_swap(parts, tiny, capsys):
    skip = ",".join(p for p in ("utilization", "sharing", "swap") if p not in parts.split(","))
    argv = [
        "bench",
        "memory",
        "--num-requests",
        "60",
        "--max-model-len",
        "512",
        "--num-blocks",
        "160",
        "--sharing-model",
        tiny,
        "--sharing-prompts",
        "3",
        "--widths",
        "2",
        "--swap-model",
        tiny,
        "--swap-tokens",
        "64",
        "--repeats",
        "1",
        "--json",
    ]
    res = _run_json(capsys, argv + (["--skip", skip] if skip else []))
    u = res["utilization"]
    assert set(u["paged"]) == {"8", "16", "32"}
    assert u["paged"]["16"]["kv_utilization"] > u["contiguous"]["kv_utilization"]
    assert u["paged"]["16"]["max_concurrent"] > u["contiguous"]["max_concurrent"]
    if "sharing" in parts:
        s = res["sharing"]
        assert 0 < s["parallel_sampling"]["2"]["saving"] < 1
        assert 0 < s["beam_search"]["2"]["saving"] < 1
        assert s["shared_prefix"]["5-shot"]["saving"] > 0
    else:
        assert "sharing" not in res
    rows = res["swap"]["rows"]
    assert [rows[b]["num_blocks"] for b in ("8", "16", "32")] == [8, 4, 2]


def test_memory_rejects_unknown_part(capsys):
    assert main(["bench", "memory", "--skip", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
