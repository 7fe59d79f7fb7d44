"""The bench commands run end to end on a tiny random-weight model (timings meaningless here)."""

from __future__ import annotations

import json

import pytest
from hf_models import make_tiny_model
from pagedjax.pallas_kernels.cpu import native as native_attention

from pagedjax.bench.throughput import cpu_ticks, steal_share
from pagedjax.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_tiny")
    make_tiny_model("llama_gqa", path, max_position_embeddings=1024)
    return str(path)


def _run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_throughput_runs_both_sides_in_their_own_processes(tiny, capsys):
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
            "--hf-unsorted",
            "--repeats",
            "2",
            "--roofline-seconds",
            "0.2",
            "--profile",
            "--json",
        ],
    )
    assert res["num_requests"] == 4 and res["max_output_len"] == 6
    theirs, ours = res["transformers"], res["pagedjax"]
    # the peer's batch size is chosen over whole-workload passes, sorted and unsorted
    assert [(r["batch_size"], r["sorted"]) for r in theirs["sweep"]] == [
        (2, True),
        (4, True),
        (2, False),
        (4, False),
    ]
    best = min(theirs["sweep"], key=lambda r: r["elapsed_s"])
    assert (theirs["batch_size"], theirs["sorted"]) == (best["batch_size"], best["sorted"])
    for side in (ours, theirs):
        assert len(side["warm"]["runs_s"]) == 2
        assert side["warm"]["min_s"] == min(side["warm"]["runs_s"])
        assert side["output_tokens_per_s"] == pytest.approx(
            res["output_tokens"] / side["warm"]["min_s"]
        )
        assert (
            0
            < side["roofline_fraction"]
            == pytest.approx(
                res["workload_gflop"]
                * 1e9
                / side["warm"]["min_s"]
                / max(res["matmul_gflops_per_s"].values())
                / 1e9
            )
        )
    # The profiled run: every step's device time falls to its kind; the CPU's native kernel
    # attends over each row's own keys, so no attention work is padding.
    prof = ours["profile"]
    kinds = prof["kinds"]
    assert set(kinds) <= {"prefill", "mixed", "decode"} and "decode" in kinds
    assert all(k["steps"] > 0 and k["device_seconds"] > 0 for k in kinds.values())
    assert sum(k["device_seconds"] for k in kinds.values()) == pytest.approx(
        prof["phases_s"]["device"]
    )
    if native_attention.available():
        assert all(k["padded_attention"] == k["real_attention"] for k in kinds.values())
    if cpu_ticks() is not None:  # Linux: each process's stolen share is reported
        shares = [res["prepare_cpu_steal_share"], ours["cpu_steal_share"]]
        assert all(0.0 <= x <= 1.0 for x in shares + [theirs["cpu_steal_share"]])
    assert ours["compilation_cache"] == "0"  # the cold run compiles for real
    assert ours["programs_compiled_cold"] > 0 and ours["programs_compiled_warm"] == 0
    assert res["warm_ratio"] == pytest.approx(
        ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    )
    assert res["cold_ratio"] == pytest.approx(theirs["cold_s"] / ours["cold_s"])
    from pagedjax.bench.throughput import print_report

    print_report(res)  # the table with the transformers side (no parameter bytes of its own)
    table = capsys.readouterr().out
    assert "transformers (batch" in table and "pagedjax parameters:" in table


def test_steal_share_is_the_stolen_part_of_the_ticks_between_two_readings():
    assert steal_share((10, 1000), (40, 1300)) == pytest.approx(0.1)
    assert steal_share((10, 1000), (10, 1000)) is None  # no time passed
    assert steal_share(None, (40, 1300)) is None  # no /proc/stat
    now = cpu_ticks()
    assert now is None or 0 <= now[0] <= now[1]


def test_workload_flops_count_tokens_attention_and_head():
    from types import SimpleNamespace

    from pagedjax.bench.roofline import flops_per_token, workload_flops
    from pagedjax.bench.throughput_sides import Request

    config = SimpleNamespace(
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    layers, head = flops_per_token(config)
    # per layer: q 8x8, k+v 8x8, o 8x8, gate+up 8x32, down 16x8 -> 2 * (64+64+64+256+128)
    assert layers == 2 * 2 * (64 + 64 + 64 + 256 + 128) and head == 2 * 8 * 100
    # prompt 3, output 2: tokens 0..3 go through the layers (4), 2 head rows, and attention
    # over 1 + 2 + 3 + 4 = 10 keys at 4 * heads * head_dim * layers FLOPs per key
    got = workload_flops(config, [Request([1, 2, 3], 2)])
    assert got == 4 * layers + 2 * head + 10 * 4 * 2 * 4 * 2


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
        "--keep-compile-cache",
        "--repeats",
        "1",
        "--roofline-seconds",
        "0.1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "workload: 2 requests" in out and "pagedjax" in out and "roofline" in out


def test_throughput_takes_vllms_flags_and_writes_its_result_file(tiny, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny, "--backend", "vllm", "--num-prompts", "3"]
    argv += ["--input-len", "8", "--output-len", "4", "--output-json", str(out)]
    argv += ["--repeats", "1", "--roofline-seconds", "0.1", "--keep-compile-cache", "--json"]
    res = _run_json(capsys, argv)
    assert res["transformers"] is None  # --backend vllm: this engine alone
    # read as vLLM's benchmark scripts read a throughput result
    raw_result = json.loads(out.read_text())
    columns = ("num_requests", "total_num_tokens", "elapsed_time")
    row = {k: raw_result[k] for k in (*columns, "requests_per_second", "tokens_per_second")}
    assert (row["num_requests"], row["total_num_tokens"]) == (3, 3 * 8 + 3 * 4)
    assert row["tokens_per_second"] == pytest.approx(row["total_num_tokens"] / row["elapsed_time"])
    assert row["requests_per_second"] == pytest.approx(3 / row["elapsed_time"])


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


def test_latency_measures_vllms_fixed_batch_and_writes_its_result_file(tiny, tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny, "--input-len", "8", "--output-len", "4"]
    argv += ["--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "3"]
    argv += ["--output-json", str(out), "--max-num-seqs", "8", "--block-size", "8"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Avg latency:" in printed and "99% percentile latency:" in printed
    # read as vLLM's benchmark scripts read a latency result
    raw_result = json.loads(out.read_text())
    row = {
        f"P{perc}": 1000 * raw_result["percentiles"][str(perc)] for perc in (10, 25, 50, 75, 90, 99)
    }
    row["avg_latency"] = raw_result["avg_latency"] * 1000
    assert len(raw_result["latencies"]) == 3 and raw_result["std_latency"] >= 0
    assert 0 < row["P10"] <= row["P50"] <= row["P99"] and row["avg_latency"] > 0
    assert raw_result["batch_size"] == 3 and raw_result["compilations_while_timed"] >= 0


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


def test_compare_quantization_runs_the_float_side_first_with_the_same_requests(monkeypatch):
    from pagedjax.bench import throughput

    calls = []

    def fake_side(side, spec, env=None):
        calls.append((side, spec.get("quantization"), spec.get("requests")))
        if side == "prepare":
            reqs = [{"prompt_token_ids": [5, 6], "output_len": 4}]
            return {"requests": reqs, "workload_flops": 1e6, "matmul_flops_per_s": {"jax": 1e9}}
        warm = 1.0 if spec["quantization"] is None else 0.5  # the quantized side twice as fast
        return {"warm": {"min_s": warm, "median_s": warm}, "cold_s": 2 * warm}

    monkeypatch.setattr(throughput, "_run_side", fake_side)
    args = throughput.build_parser().parse_args(
        ["--model", "m", "--skip-hf", "--quantization", "fp8", "--compare-quantization"]
    )
    res = throughput.benchmark(args)
    assert [(side, q) for side, q, _ in calls] == [
        ("prepare", "fp8"),
        ("pagedjax", None),
        ("pagedjax", "fp8"),
    ]
    assert calls[1][2] == calls[2][2] == [{"prompt_token_ids": [5, 6], "output_len": 4}]
    assert res["quantization_warm_ratio"] == pytest.approx(2.0)
    assert res["quantization_cold_ratio"] == pytest.approx(2.0)
    assert res["pagedjax_unquantized"]["output_tokens_per_s"] == pytest.approx(4.0)


@pytest.mark.slow
def test_throughput_compares_quantized_with_unquantized_pagedjax(tiny, capsys):
    from pagedjax.bench.throughput import print_report

    argv = ["bench", "throughput", "--model", tiny, "--num-requests", "3", "--max-prompt-len"]
    argv += ["12", "--max-output-len", "4", "--skip-hf", "--keep-compile-cache", "--repeats", "1"]
    argv += ["--roofline-seconds", "0.1", "--quantization", "int8-g32", "--compare-quantization"]
    res = _run_json(capsys, [*argv, "--json"])
    ours, base = res["pagedjax"], res["pagedjax_unquantized"]
    assert (ours["quantization"], ours["kernel_dtype"]) == ("int8-g32", "int8")
    assert (base["quantization"], base["kernel_dtype"]) == (None, "float32")
    assert ours["param_bytes"] < base["param_bytes"]
    assert res["quantization_warm_ratio"] == pytest.approx(
        ours["output_tokens_per_s"] / base["output_tokens_per_s"]
    )
    print_report(res)  # the table: both sides and their ratio
    out = capsys.readouterr().out
    assert "pagedjax (unquantized)" in out and "pagedjax (int8-g32)" in out
    assert "ratio pagedjax int8-g32 / unquantized" in out
    assert main(["bench", "throughput", "--model", tiny, "--compare-quantization"]) == 2
    assert "--compare-quantization needs --quantization" in capsys.readouterr().err


def test_decode_step_breakdown_times_the_step_with_and_without_attention(tiny, tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "decode_step_breakdown.py"
    spec = importlib.util.spec_from_file_location("decode_step_breakdown", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "breakdown.json"
    argv = ["--model", tiny, "--batches", "1", "3", "--contexts", "20", "300"]
    assert module.main([*argv, "--calls", "1", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    # Each cell ran both variants (the script fails if the stub left the logits unchanged);
    # 300 tokens of context take the chunked path, 20 the one-pass reference.
    cells = [(r["batch"], r["context"]) for r in res["rows"]]
    assert cells == [(1, 20), (3, 20), (1, 300), (3, 300)]
    assert all(r["full_ms"] > 0 and r["no_attention_ms"] > 0 for r in res["rows"])
    assert res["param_bytes"] > 0 and res["stream_s"] > 0
    assert all(res["scan_toy"][k] > 0 for k in ("scan_s", "loop_s", "host_loop_s"))
    from pagedjax.pallas_kernels import NativeBackend

    assert NativeBackend.decode.__name__ == "decode"  # restored
