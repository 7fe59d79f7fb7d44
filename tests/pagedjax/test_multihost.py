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


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all sockets held until every port is chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def env(devices: int, cache_dir: Path) -> dict:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "PAGEDJAX_CACHE_DIR": str(cache_dir),
    }


def start(args: list[str], devices: int, cache_dir: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # a file, not a pipe: a chatty process never blocks
        return subprocess.Popen(
            [sys.executable, *args], env=env(devices, cache_dir), stdout=out, stderr=out
        )


def wait_all(procs: list[tuple[subprocess.Popen, Path]], timeout: float) -> None:
    """Wait for every process; as soon as one fails, or at the deadline, kill the rest (a
    follower would wait forever for a driver that died) and fail with the failed one's log."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _ in procs):
            for p, log in procs:
                assert p.poll() in (None, 0), log.read_text()[-4000:]
            assert time.monotonic() < deadline, "timed out:\n" + procs[0][1].read_text()[-4000:]
            time.sleep(0.5)
        for p, log in procs:
            assert p.returncode == 0, log.read_text()[-4000:]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama_gqa", d)  # 4 heads, 2 KV heads: TP 4 replicates KV heads
    save_word_tokenizer(d)
    return d


def run_workers(model_dir: Path, out: Path, num_processes: int) -> list[dict]:
    """Run the worker as ``num_processes`` processes over 4 devices in all, each converting the
    model into a fresh cache (written by all processes at once when there are two)."""
    (port,) = free_ports(1)
    procs = [
        (
            start(
                [str(WORKER), str(model_dir), str(out), str(num_processes), str(pid), str(port)],
                4 // num_processes,
                out / "cache",
                out / f"log{pid}.txt",
            ),
            out / f"log{pid}.txt",
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
    # The plumbing of one program on every process: a follower's generate returns the outputs
    # the driver broadcast (its own devices ran the same steps).
    _, (driver, follower), _ = runs
    assert follower["process_index"] == 1
    for key in RESULTS:
        assert follower[key] == driver[key], key


def test_messages_of_every_size_arrive_whole(runs):
    _, (driver, follower), _ = runs
    assert follower["channel"] == [True] * 4  # around the first broadcast's 16 KiB, and 100 kB


def test_a_closed_engine_refuses_work_on_every_process(runs):
    _, (driver, follower), _ = runs
    assert driver["after_close"] == follower["after_close"] == "the engine is closed"


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
def test_serve_from_process_0_while_process_1_follows(model_dir, runs, tmp_path):
    one, _, cache = runs  # the two-process run's cache: each process restores its slices
    coordinator, http = free_ports(2)
    procs = []
    for pid in range(2):
        args = ["-m", "pagedjax.cli", "serve", "--model", str(model_dir)]
        args += ["--tensor-parallel-size", "4", "--max-model-len", "128", "--port", str(http)]
        args += ["--no-warmup"]
        args += ["--coordinator-address", f"127.0.0.1:{coordinator}"]
        args += ["--num-processes", "2", "--process-id", str(pid)]
        log = tmp_path / f"serve{pid}.txt"
        procs.append((start(args, 2, cache, log), log))
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p, _ in procs), "a server process exited early"
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
        if procs[0][0].poll() is None:
            procs[0][0].send_signal(signal.SIGINT)  # the driver shuts down and stops process 1
        wait_all(procs, timeout=120)
