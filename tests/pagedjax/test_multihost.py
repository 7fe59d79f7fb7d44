"""Multi-process runs through jax.distributed on loopback, with CPU collectives: two processes of
two virtual devices each (tensor parallelism over all four) give exactly what one process of four
devices gives, and ``pagedjax serve`` serves from process 0 while process 1 follows."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from hf_models import make_tiny_model, save_word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int, cache_dir: Path) -> dict:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "PAGEDJAX_CACHE_DIR": str(cache_dir),
    }


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every process; on a timeout or a failure kill the rest (a follower would wait
    forever for a driver that died). Returns their outputs."""
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            outputs.append(out)
            assert p.returncode == 0, out[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outputs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama_gqa", d)  # 4 heads, 2 KV heads: TP 4 replicates KV heads
    save_word_tokenizer(d)
    return d


def run_workers(model_dir: Path, out: Path, num_processes: int) -> list[dict]:
    """Run the worker as ``num_processes`` processes over 4 devices in all, each converting the
    model into a fresh cache (written by all processes at once when there are two)."""
    port, devices = free_port(), 4 // num_processes
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(model_dir), str(out), str(num_processes)]
            + [str(pid), str(port)],
            env=env(devices, out / "cache"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(num_processes)
    ]
    wait_all(procs, timeout=600)
    return [json.loads((out / f"process{i}.json").read_text()) for i in range(num_processes)]


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    one = run_workers(model_dir, tmp_path_factory.mktemp("one"), 1)[0]
    two_dir = tmp_path_factory.mktemp("two")
    two = run_workers(model_dir, two_dir, 2)
    return one, two, two_dir / "cache"


RESULTS = ("greedy", "sampled", "beams", "text", "error", "num_preemptions", "num_swapped_out")


def test_two_processes_match_one(runs):
    one, (driver, follower), _ = runs
    assert (one["process_count"], one["devices"]) == (1, 4)
    assert (driver["process_count"], driver["local_devices"], driver["devices"]) == (2, 2, 4)
    for key in RESULTS:
        assert driver[key] == one[key], key


def test_every_process_returns_the_drivers_results(runs):
    _, (driver, follower), _ = runs
    assert follower["process_index"] == 1
    for key in RESULTS:
        assert follower[key] == driver[key], key


def test_the_run_swapped_and_a_bad_request_failed_everywhere(runs):
    _, (driver, follower), _ = runs
    assert driver["num_preemptions"] > 0 and driver["num_swapped_out"] > 0
    assert "token id 1000000" in driver["error"]
    assert follower["error"] == driver["error"]


def test_the_cache_is_shared_only_when_every_process_sees_it(runs):
    _, (driver, follower), cache = runs
    assert driver["cache_shared"] and follower["cache_shared"]
    assert not driver["own_dir_shared"] and not follower["own_dir_shared"]
    assert len(list((cache / "params").glob("*/COMPLETE"))) == 1  # written by both processes


@pytest.mark.slow  # about 30 s more: two more processes load, compile and serve
def test_serve_from_process_0_while_process_1_follows(model_dir, runs):
    one, _, cache = runs  # the two-process run's cache: each process restores its slices
    coordinator, http = free_port(), free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", "--model", str(model_dir)]
            + ["--tensor-parallel-size", "4", "--max-model-len", "128", "--port", str(http)]
            + ["--coordinator-address", f"127.0.0.1:{coordinator}"]
            + ["--num-processes", "2", "--process-id", str(pid)],
            env=env(2, cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in procs), "a server process exited early"
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(1)
        body = {"model": str(model_dir), "prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert reply["choices"][0]["text"] == one["text"]
    finally:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGINT)  # the driver shuts down and stops process 1
    wait_all(procs, timeout=120)
