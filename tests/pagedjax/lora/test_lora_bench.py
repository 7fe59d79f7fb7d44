"""``pagedjax bench throughput --num-loras N``: the pagedjax side runs again, after the base-only
run and with the same requests, under N random adapters mixed evenly; the report gives its
throughput as a fraction of the base-only run's (timings meaningless here)."""

from __future__ import annotations

import json

import pytest
from hf_models import make_tiny_model

from pagedjax.bench import throughput
from pagedjax.bench.throughput_lora import lora_options, mixed_evenly
from pagedjax.cli import main


def test_the_lora_side_runs_after_the_base_only_one_with_the_same_requests(monkeypatch):
    calls = []

    def fake_side(side, spec, env=None):
        calls.append((side, spec.get("num_loras"), spec.get("requests")))
        if side == "prepare":
            reqs = [{"prompt_token_ids": [5, 6], "output_len": 4}]
            return {"requests": reqs, "workload_flops": 1e6, "matmul_flops_per_s": {"jax": 1e9}}
        warm = 1.0 if not spec.get("num_loras") else 1.25  # the LoRA side 0.8x as fast
        return {"warm": {"min_s": warm, "median_s": warm}, "cold_s": 2 * warm, "num_loras": 4}

    monkeypatch.setattr(throughput, "_run_side", fake_side)
    args = throughput.build_parser().parse_args(["--model", "m", "--skip-hf", "--num-loras", "4"])
    res = throughput.benchmark(args)
    assert [(side, n) for side, n, _ in calls] == [
        ("prepare", None),
        ("pagedjax", None),
        ("pagedjax", 4),
    ]
    assert calls[1][2] == calls[2][2]
    assert res["lora_warm_ratio"] == pytest.approx(0.8)
    assert res["lora_cold_ratio"] == pytest.approx(0.8)
    assert res["pagedjax_lora"]["output_tokens_per_s"] == pytest.approx(3.2)


def test_adapters_are_mixed_evenly_and_options_checked(capsys):
    assert mixed_evenly(["a", "b"], 5) == ["a", "b", "a", "b", "a"]
    assert mixed_evenly([], 2) == [None, None]
    assert lora_options({"num_loras": 0}) == {}
    assert lora_options({"num_loras": 3, "max_lora_rank": 8}) == {
        "enable_lora": True,
        "max_loras": 3,
        "max_lora_rank": 8,
    }
    assert main(["bench", "throughput", "--num-loras", "-1"]) == 2
    assert "--num-loras must be >= 0" in capsys.readouterr().err


@pytest.mark.slow  # three processes load the model, two compile
def test_throughput_with_loras_end_to_end(tmp_path, capsys):
    make_tiny_model("llama_gqa", tmp_path)
    argv = ["bench", "throughput", "--model", str(tmp_path), "--num-requests", "4"]
    argv += ["--max-prompt-len", "12", "--max-output-len", "4", "--skip-hf", "--repeats", "1"]
    argv += ["--roofline-seconds", "0.1", "--keep-compile-cache", "--num-loras", "2", "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    lora, base = res["pagedjax_lora"], res["pagedjax"]
    assert (lora["num_loras"], base["num_loras"]) == (2, 0)
    assert res["lora_warm_ratio"] == pytest.approx(
        lora["output_tokens_per_s"] / base["output_tokens_per_s"]
    )
    throughput.print_report(res)
    assert "ratio pagedjax with LoRAs / base only" in capsys.readouterr().out
