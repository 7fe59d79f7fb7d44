"""The GPU benchmark script's CPU smoke mode (``--interpret --small``) runs end to end."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "paged_attention_gpu.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("paged_attention_gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_benchmark_small_interpret_mode_runs_and_checks_correctness(capsys):
    bench = load_benchmark()
    rows, info = bench.main(["--interpret", "--small"])
    printed = capsys.readouterr().out
    assert "| batch | context |" in printed and "copy" in printed
    assert len(rows) == len(bench.SMALL_BATCHES) * len(bench.SMALL_CONTEXTS)
    for row in rows:
        assert row.ours_err < 1.5e-2, f"ours vs reference: rel err {row.ours_err:.2e}"
        assert row.jax_err < 1.5e-2, f"JAX's op vs reference: rel err {row.jax_err:.2e}"
        assert row.ours_us > 0 and row.jax_us > 0 and row.copy_gbps > 0
    assert info["ours_finite"], "our kernel let NaN from stale slots into the output"
