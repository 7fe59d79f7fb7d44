"""What the server spends on answers, whole or streamed: a tiny byte-level model (its compute
negligible next to the server's), ``--concurrency`` clients in a process of their own each
sending completions of ``--max-tokens`` tokens (greedy, EOS ignored), ``--batches`` timed batches
of twice the concurrency, after one untimed. Prints the wall time per batch (min and median) and
the CPU seconds the server's processes spent over the timed batches (``ps``: the API process and,
with ``--engine-process``, the engine process).

    python benchmarks/served_answers.py [--engine-process] [--stream] [--concurrency 32]
                                        [--max-tokens 100] [--batches 8] [--logprobs K]

The server is ``pagedjax serve`` of the checkout this file sits in. To compare with an older
checkout in the same sitting, copy this file into that checkout's ``benchmarks/`` and run it
there. Time it on a quiet machine, nothing else running.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY, MODEL = "bench-key", "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of pid and its children, from /proc."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    total = 0
    for p in [pid, *map(int, out.stdout.split())]:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def start_server(model_dir: str, port: int, engine_process: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedjax", "serve", "--model", model_dir, "--port", str(port)]
    cmd += ["--api-key", KEY, "--served-model-name", MODEL, "--block-size", "16"]
    cmd += ["--num-blocks", "1100", "--max-model-len", "512", "--max-num-seqs", "32"]
    cmd += ["--no-background-compile"] + (["--engine-process"] if engine_process else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}") from None
            time.sleep(0.5)
    server.terminate()
    raise RuntimeError("the server did not answer /health within 10 minutes")


def clients(
    port: int, concurrency: int, max_tokens: int, stream: bool, batches: int, logprobs: int | None
) -> None:
    """The client process: one untimed batch (first-use compiles), then ``batches`` timed."""
    body = {"model": MODEL, "prompt": "z" * 20, "max_tokens": max_tokens, "temperature": 0}
    if logprobs is not None:
        body["logprobs"] = logprobs
    data = json.dumps(body | {"ignore_eos": True, "stream": stream}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def send(_) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", data, headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for i in range(batches + 1):
            t0 = time.monotonic()
            statuses = set(pool.map(send, range(2 * concurrency)))
            if statuses != {200}:
                raise SystemExit(f"statuses {statuses}")
            print(time.monotonic() - t0 if i else "warm", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-process", action="store_true")
    parser.add_argument("--stream", action="store_true", help="streamed answers, else whole")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--batches", type=int, default=8, help="timed batches")
    parser.add_argument("--logprobs", type=int, default=None, help="each answer's top logprobs")
    parser.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)  # its port
    args = parser.parse_args(argv)
    if args.client is not None:
        clients(
            args.client, args.concurrency, args.max_tokens, args.stream, args.batches, args.logprobs
        )
        return 0
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]
    from server_helpers import make_byte_model

    model_dir = tempfile.mkdtemp(prefix="served-answers-")
    make_byte_model(model_dir)
    print(f"load average {os.getloadavg()[0]:.2f} at the start; checkout {ROOT}")
    port = free_port()
    server = start_server(model_dir, port, args.engine_process)
    try:
        argv = [sys.executable, __file__, "--client", str(port), "--batches", str(args.batches)]
        argv += ["--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens)]
        argv += ["--stream"] * args.stream
        if args.logprobs is not None:
            argv += ["--logprobs", str(args.logprobs)]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as client:
            lines = iter(client.stdout.readline, "")
            if next(lines, "").strip() != "warm":  # the untimed batch (first-use compiles)
                raise SystemExit("the clients failed in their first batch")
            cpu0 = cpu_seconds(server.pid)
            walls = [float(line) for line in lines]
        cpu = cpu_seconds(server.pid) - cpu0
        if client.returncode or len(walls) != args.batches:
            raise SystemExit(f"the clients failed (exit {client.returncode})")
    finally:
        server.terminate()
        server.wait(60)
    kind = "streamed" if args.stream else "whole"
    if args.logprobs is not None:
        kind += f" (logprobs {args.logprobs})"
    mode = "engine process" if args.engine_process else "engine thread"
    print(
        f"{mode}, {kind} answers, {2 * args.concurrency} x {args.max_tokens} tokens per batch at "
        f"concurrency {args.concurrency}: min {min(walls):.3f} s, median "
        f"{statistics.median(walls):.3f} s per batch; server CPU {cpu:.1f} s over the "
        f"{args.batches} batches"
    )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
