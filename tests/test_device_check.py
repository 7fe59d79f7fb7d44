"""benchmarks/device_check/ on CPU: stages 2-4 at toy sizes (kernels interpreted), and the
guarding that lets one stage fail, overrun or stop early while the next still runs."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "benchmarks" / "device_check"


def load_device_check():
    if str(PACKAGE.parent) not in sys.path:
        sys.path.insert(0, str(PACKAGE.parent))
    return importlib.import_module("device_check")


@pytest.fixture(scope="module")
def dc():
    return load_device_check()


def test_toy_run_of_stages_2_to_4_passes_and_reports(dc, tmp_path, capsys):
    ctx = dc.main(["--toy", "--stages", "2,3,4", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    results = ctx.results
    assert list(results) == ["kernels", "engine_tiny", "engine_8b", "decode"]
    for key, r in results.items():
        assert r.status == "PASS", f"{key}: {r.status} {r.summary}\n{r.error}"

    # 2: every axis value covered, ours within tolerance and NaN-free on poisoned pools.
    cases = results["kernels"].data["cases"]
    ours = [c for c in cases if c["op"] == "ours"]
    assert {c["kind"] for c in ours} == {"decode", "ragged"}
    assert {c["dtype"] for c in ours} == {"float32", "bfloat16"}
    assert {c["gqa"] for c in ours} == {1, 4, 8}
    assert {c["block_size"] for c in ours} == {16, 32}
    assert all(c["finite"] and c["rel_err"] <= c["tol"] for c in ours)
    assert all(c["padding_rows_zero"] for c in ours if c["kind"] == "ragged")
    assert [c for c in cases if c["op"] == "jax"], "JAX's shipped op was not compared"
    lowering = results["kernels"].data["lowering"]
    assert set(lowering) == {"ours/decode", "ours/ragged", "jax_op/decode"}
    assert all("lowers to triton for cuda" in v for v in lowering.values()), lowering

    # 3a: same greedy tokens as transformers, with preemption and prefix hits.
    (run,) = results["engine_tiny"].data["runs"]
    assert run["equal"] == run["prompts"] and run["num_preemptions"] > 0
    assert run["prefix_cache_hits"] > 0

    # 3b: the warm run reuses the cold run's programs.
    big = results["engine_8b"].data
    assert big["warm"]["output_tokens_per_s"] > 0
    assert big["cold_compiles"]["count"] >= 1 and big["warm_compiles"]["count"] == 0
    assert big["stats"]["num_blocks_peak"] > 0
    decode_profile = big["profile"]["per_kind"]["decode"]  # the profiled run: ms and MBU per kind
    assert decode_profile["device_ms"] > 0 and decode_profile["host_ms"] > 0
    assert 0 < decode_profile["mbu"] <= 2.0

    # 4: the decode benchmark's rows and its NaN check.
    decode = results["decode"].data
    assert decode["rows"] and decode["summary"]["ours_finite"]

    payload = json.loads((tmp_path / "device_check.json").read_text())
    assert set(payload["stages"]) == set(results)
    assert payload["stages"]["kernels"]["status"] == "PASS"
    log = (tmp_path / "device_check.log").read_text()
    assert "| # | stage | status | s | result |" in printed
    assert "| 3b | engine_8b | PASS |" in log


def test_a_failing_overrunning_or_spent_stage_is_recorded_and_the_next_runs(
    dc, tmp_path, monkeypatch
):
    def boom(ctx, budget, data):
        raise ValueError("boom")

    def overrun(ctx, budget, data):
        while True:  # never checks its budget: the hard limit stops it
            time.sleep(0.01)

    def spent(ctx, budget, data):
        data["partial"] = "1 of 2 steps"
        time.sleep(budget.seconds + 0.01)
        budget.check("step 2")
        return True, "unreachable"

    def fine(ctx, budget, data):
        data["ran"] = True
        return True, "fine"

    for key, fn in (("env", boom), ("kernels", overrun), ("engine_tiny", spent), ("decode", fine)):
        number, title, _ = dc.STAGES[key]
        monkeypatch.setitem(dc.STAGES, key, (number, title, fn))
    monkeypatch.setattr(dc.running, "HARD_FACTOR", 1.0)
    monkeypatch.setattr(dc.running, "HARD_SLACK_S", 0.2)
    argv = ["--toy", "--stages", "1,2,3a,4", "--budget-scale", "0.001", "--out", str(tmp_path)]
    ctx = dc.main(argv)
    r = ctx.results
    assert r["env"].status == "ERROR" and "ValueError: boom" in r["env"].error
    assert r["kernels"].status == "ERROR" and "StageTimeout" in r["kernels"].error
    assert r["engine_tiny"].status == "PARTIAL" and "1 of 2 steps" in r["engine_tiny"].summary
    assert r["decode"].status == "PASS" and r["decode"].data == {"ran": True}
    stages = json.loads((tmp_path / "device_check.json").read_text())["stages"]
    assert [stages[k]["status"] for k in ("env", "kernels", "engine_tiny", "decode")] == [
        "ERROR",
        "ERROR",
        "PARTIAL",
        "PASS",
    ]


def test_stage_selection_by_number_group_or_name(dc):
    assert dc.parse_args(["--stages", "3"]).stage_keys == ["engine_tiny", "engine_8b"]
    assert dc.parse_args(["--stages", "peer,1"]).stage_keys == ["env", "peer"]
    assert dc.parse_args(["--stages", "6"]).stage_keys == ["serve"]
    with pytest.raises(SystemExit):
        dc.parse_args(["--stages", "99"])


@pytest.mark.slow  # about 30 s on a loaded 2-core machine: a pagedjax server starts
def test_toy_serve_stage_measures_pagedjax_serve_and_a_peer_side_by_side(dc, tmp_path, monkeypatch):
    """Stage 6 on CPU: the tiny random model served by ``pagedjax serve`` and by a stub
    OpenAI-like peer (started with --peer), one after the other; an uninstalled peer is skipped
    with its reason. Both servers' rows, the ratios and the plot land in the JSON and the log."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "pagedjax" / "bench"))
    from test_bench_serve import STUB

    stub = tmp_path / "stub_server.py"
    stub.write_text(STUB)
    peer = f"stub={sys.executable} {stub} --port {{port}} --usage"
    serve = dataclasses.replace(dc.sizes.TOY.serve, peers=(peer, "sglang"))
    monkeypatch.setattr(dc.sizes, "TOY", dataclasses.replace(dc.sizes.TOY, serve=serve))
    out = tmp_path / "out"
    ctx = dc.main(["--toy", "--stages", "6", "--out", str(out)])
    r = ctx.results["serve"]
    assert r.status == "PASS", f"{r.status} {r.summary}\n{r.error}"
    data = r.data
    assert "sglang" in data["peers_skipped"]
    rows = {(row["server"], row["max_concurrency"]): row for row in data["rows"]}
    assert set(rows) == {(s, c) for s in ("pagedjax", "stub") for c in serve.concurrency}
    for (server, conc), row in rows.items():
        n = serve.num_prompts[serve.concurrency.index(conc)]
        assert (row["completed"], row["failed"], row["exact_lengths"]) == (n, 0, n), server
        assert row["total_output_tokens"] == n * serve.output_len
    assert [s["server"] for s in data["servers"]] == ["pagedjax", "stub"]
    assert all(s["ready_s"] > 0 for s in data["servers"])
    for q in data["ratios"]:
        c = q["max_concurrency"]
        want = rows["pagedjax", c]["output_throughput"] / rows["stub", c]["output_throughput"]
        assert q["peer"] == "stub" and q["output_throughput"] == pytest.approx(want)
    assert sorted(q["max_concurrency"] for q in data["ratios"]) == list(serve.concurrency)
    assert data["command"].startswith("pagedjax bench serve --peer ")
    assert (out / "bench_serve.png").stat().st_size > 0
    assert (out / "serve_logs" / "pagedjax.log").exists()
    stages = json.loads((out / "device_check.json").read_text())["stages"]
    assert len(stages["serve"]["data"]["rows"]) == 2 * len(serve.concurrency)
    assert "| 6 | serve | PASS |" in (out / "device_check.log").read_text()


def test_serve_stage_without_its_packages_is_skipped_with_their_names(dc, tmp_path, monkeypatch):
    serve = dc.stages.serve
    monkeypatch.setattr(serve, "SERVE_MODULES", (*serve.SERVE_MODULES, "no_such_module_for_serve"))
    monkeypatch.setattr(serve, "WHEELHOUSE", tmp_path / "no-wheels")
    ctx = dc.main(["--toy", "--stages", "serve", "--out", str(tmp_path)])
    r = ctx.results["serve"]
    assert r.status == "SKIP" and "no_such_module_for_serve" in r.summary
    assert "make wheelhouse" in r.summary


def test_the_folder_runs_as_a_command_and_every_stage_module_is_registered(dc):
    """``python3 benchmarks/device_check --help`` (the Makefile's command) works from anywhere,
    and each module under stages/ is in the registry (a stage added is a stage run)."""
    r = subprocess.run(
        [sys.executable, str(PACKAGE), "--help"],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "--stages" in r.stdout and "Adding a stage" in r.stdout
    modules = {p.stem for p in (PACKAGE / "stages").glob("*.py")} - {"__init__"}
    registered = {fn.__module__.rsplit(".", 1)[1] for _, _, fn in dc.STAGES.values()}
    assert registered == modules


def test_env_stage_names_the_gpu_lowering_of_this_checkout(dc):
    assert dc.stages.env.gpu_lowering() == "triton"


def test_toy_probe_stage_times_both_layer_loops_and_dispatch_against_ready(dc, tmp_path):
    ctx = dc.main(["--toy", "--stages", "probe", "--out", str(tmp_path)])
    r = ctx.results["probe"]
    assert r.status == "PASS", f"{r.summary}\n{r.error}"
    rows = r.data["layer_loop"]
    assert {(x["loop"], x["rows"]) for x in rows} == {
        (loop, m) for loop in ("scan", "unrolled") for m in (1, 8)
    }
    assert all(x["per_layer_weights"] == (x["loop"] == "unrolled") for x in rows)
    assert all(x["step_ms"] > 0 and x["of_floor"] > 0 for x in rows)
    assert r.data["copy_gbps"] > 0
    variants = [x["variant"] for x in r.data["dispatch"]]
    assert variants == ["greedy", "sampling top-p", "penalties", "top logprobs"]
    assert all(0 < x["dispatch_ms"] <= x["ready_ms"] for x in r.data["dispatch"])
    assert set(r.data["control"]) == {"plain", "cond"}


def test_probe_verdict_fails_on_a_device_where_dispatch_waited(dc):
    probe = dc.stages.probe
    ctx = dc.common.Context(sizes=dc.sizes.DEVICE, platform="gpu", interpret=False, out=Path("."))
    data = {
        "layers": 8,
        "layer_loop": [dict(loop="unrolled", rows=64, of_floor=0.9)],
        "dispatch": [
            dict(variant="greedy", dispatch_ms=0.1, ready_ms=2.0),
            dict(variant="top logprobs", dispatch_ms=1.95, ready_ms=2.0),
        ],
        "control": {"cond": dict(dispatch_ms=1.4, ready_ms=1.5)},
    }
    ok, summary = probe.verdict(ctx, data)
    assert not ok and data["host_waits"] == ["top logprobs"] and "top logprobs" in summary
    data["dispatch"].pop()
    assert probe.verdict(ctx, data)[0]


def test_every_dependency_serving_imports_is_in_the_image_or_the_wheelhouse(dc):
    """The device image lacks some of the project's dependencies: each one that ``pagedjax
    serve`` and ``pagedjax bench serve`` import must be a SERVE_MODULES entry (carried as a
    wheel by ``make wheelhouse``), or stage 6 fails on the device at import."""
    import tomllib

    serve = dc.stages.serve
    project = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0] for d in project["dependencies"]}
    modules = {n.replace("-", "_").removesuffix("_checkpoint") for n in names}
    code = (
        "import sys, pagedjax.cli, pagedjax.entrypoints.api_server, "
        "pagedjax.engine.hosting.engine_process, pagedjax.entrypoints.llm, "
        "pagedjax.bench.serve\n"
        "import uvicorn  # imported when the server starts\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = set(r.stdout.split()) & modules
    assert imported, r.stdout
    assert imported - set(serve.IN_IMAGE) <= set(serve.SERVE_MODULES), imported
