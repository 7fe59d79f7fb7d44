"""The server soak's parts, shared by its test (tests/pagedjax/entrypoints/test_server_soak.py)
and its benchmark (benchmarks/server_soak.py): a real ``pagedjax serve --engine-process`` on a tiny
model, 200 hostile bodies from issue 41's classes (grammar bombs, a regex over llguidance's
limits with n = 8, echo with 20 logprobs, megabyte prompts, long choice lists, huge integer
bounds, malformed logit_bias keys, deep schemas given as strings, clients that leave
mid-stream) and 64 normal greedy streams timed alone and in the midst of the hostile flood.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import subprocess
import sys
import threading
import time

import soak_clients
from server_helpers import (
    free_port,
    make_byte_model,
    metrics,
    raw,
    sse_events,
    wait_idle,
)

KEY = "soak-key"
MODEL = "tiny-soak"
NORMAL = 64
HOSTILE = 200
NORMAL_TOKENS = 24
PROMPTS = ["Hello there", "caf\u00e9 au lait", "abc def", "The cat sat."]


def ref_chain(depth: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def any_of_chain(depth: int) -> dict:
    defs = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(rules: int) -> str:
    lines = [f"r{i}: r{i + 1}" for i in range(rules)]
    return "start: r0\n" + "\n".join(lines) + f'\nr{rules}: "a"\n'


def gbnf_chain(rules: int) -> str:
    lines = [f"r{i} ::= r{i + 1}" for i in range(rules)]
    return "root ::= r0\n" + "\n".join(lines) + f'\nr{rules} ::= "a"\n'


# The classes a server answers 200 (a long choice list, echo with prompt logprobs, a client that
# leaves a stream): valid requests whose work the engine shares with the normal streams. Every
# other class is refused with a 4xx before it reaches the engine.
SERVED_CLASSES = (5, 8, 9, 17)
CLASSES = 18  # hostile_bodies' classes


def hostile_bodies(seed: int, which: str = "all") -> list[tuple[str, dict | bytes]]:
    """(path, body) of each class in turn, HOSTILE in all; ``which``: "all" classes, those
    "served" or those "refused", one class by its index ("8"), or "ordinary": the normal
    streams' own request, HOSTILE times (the control: what the same clients cost the normal
    streams when what they send is ordinary work)."""
    if which == "ordinary":
        return [("/v1/completions", normal_body(i)) for i in range(HOSTILE)]
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    so = "structured_outputs"
    classes = [
        ("/v1/completions", {"prompt": "Hi", so: {"json": ref_chain(1500)}}),
        ("/v1/completions", {"prompt": "Hi", so: {"json": any_of_chain(1500)}}),
        ("/v1/completions", {"prompt": "Hi", so: {"grammar": lark_chain(3000)}}),
        ("/v1/completions", {"prompt": "Hi", so: {"grammar": gbnf_chain(5000)}}),
        ("/v1/completions", {"prompt": "Hi", "n": 8, so: {"regex": "(a{1000}){1000}"}}),
        ("/v1/completions", {"prompt": "Hi", so: {"choice": [f"c{i}" for i in range(2500)]}}),
        (
            "/v1/completions",
            {"prompt": "Hi", so: {"json": {"type": "integer", "minimum": 1e30, "maximum": 1e31}}},
        ),
        ("/v1/completions", {"prompt": "Hi", so: {"json": "[" * 5000 + "]" * 5000}}),
        ("/v1/completions", {"prompt": ["z" * 80] * 8, "echo": True, "logprobs": 20}),
        ("/v1/completions", {"prompt": "x" * 80, "echo": True, "logprobs": 20, "max_tokens": 8}),
        ("/v1/completions", {"prompt": "big prompt " * 20000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "m " * 100000}]}),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"\u00b2": 1, "--5": 2}}),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5" * 5000: 1}}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": 5}]}),
        ("/v1/completions", b'{"model": "tiny-soak", "prompt": ' + b"[" * 100000),
        ("leave", {"prompt": "Hi", "max_tokens": 60, "stream": True, "ignore_eos": True}),
    ]
    assert len(classes) == CLASSES
    if which.isdigit():
        classes = [classes[int(which)]]
    elif which != "all":
        served = which == "served"
        classes = [c for i, c in enumerate(classes) if (i in SERVED_CLASSES) == served]
    rng = random.Random(seed)
    bodies = [classes[i % len(classes)] for i in range(HOSTILE)]
    rng.shuffle(bodies)
    out = []
    for path, body in bodies:
        if isinstance(body, dict):
            body = {"model": MODEL, "max_tokens": 4, **body}
        out.append((path, body))
    return out


def normal_body(i: int) -> dict:
    return {
        "model": MODEL,
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": NORMAL_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def normal_stream(base: str, i: int) -> tuple[str, float]:
    body = normal_body(i)
    start = time.monotonic()
    status, reply = raw(base, "POST", "/v1/completions", body, key=KEY, timeout=300)
    latency = time.monotonic() - start
    assert status == 200, reply[:300]
    events = sse_events(reply)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]), latency


def run_normal(base: str, pool) -> tuple[list[str], list[float]]:
    results = list(pool.map(lambda i: normal_stream(base, i), range(NORMAL)))
    return [r[0] for r in results], [r[1] for r in results]


@contextlib.contextmanager
def served(tmp_path):
    make_byte_model(tmp_path)
    port = free_port()
    argv = [sys.executable, "-c", "from pagedjax.cli import main; main()", "serve"]
    argv += ["--model", str(tmp_path), "--port", str(port), "--api-key", KEY]
    argv += ["--served-model-name", MODEL, "--block-size", "8", "--num-blocks", "400"]
    argv += ["--max-model-len", "96", "--max-num-seqs", "16", "--engine-process"]
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = wait_healthy(proc, port, tmp_path / "server.log")
            yield base, proc, tmp_path / "server.log"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_healthy(proc, port: int, log, timeout: float = 600) -> str:
    """The server's base URL once /health answers 200 (its log's tail if it exits first)."""
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if raw(base, "GET", "/health", key=None, timeout=5)[0] == 200:
                return base
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.5)


def run_mixed(
    base: str, normal_pool, seed: int, which: str = "all", rate: float | None = None
) -> tuple[list[str], list[float], list[int], int]:
    """The normal streams timed while the hostile bodies are sent, from processes of their own
    as hostile clients are (their megabyte replies are read and freed there): four at a time,
    each client sending its next body when the last is answered (a closed loop: a server that
    answers sooner is sent more), or with ``rate``, ``rate`` bodies a second whatever the
    answers (an open loop, from up to 16 clients). Every client process is started before the
    flood, and the normal streams start once the flood is under way, so that they run in its
    midst and starting clients is not timed."""
    port = int(base.rsplit(":", 1)[1])
    bodies = hostile_bodies(seed, which)
    clients = 4 if rate is None else 16
    with multiprocessing.get_context("spawn").Pool(clients) as hostile_pool:
        started: set[int] = set()
        while len(started) < clients:
            started.update(hostile_pool.map(soak_clients.ready, range(clients), chunksize=1))
        hostile = []

        def flood():
            start = time.monotonic()
            for i, (path, body) in enumerate(bodies):
                if rate is not None:
                    time.sleep(max(0.0, start + i / rate - time.monotonic()))
                hostile.append(hostile_pool.apply_async(soak_clients.send, (port, KEY, path, body)))

        feeder = threading.Thread(target=flood)
        feeder.start()
        while sum(r.ready() for r in list(hostile)) < 8:  # the flood under way
            time.sleep(0.01)
        texts, latencies = run_normal(base, normal_pool)
        answered = sum(r.ready() for r in list(hostile))
        unanswered = len(bodies) - answered  # in flight or not sent when the streams ended
        feeder.join()
        statuses = [r.get(timeout=600) for r in hostile]
    # Until the engine has let go of every request (a client that left a stream is noticed at
    # the stream's next write): what comes next, the normal streams timed alone, runs alone.
    wait_idle(base, timeout=120, key=KEY)
    return texts, latencies, statuses, unanswered


def wait_background_compile(base: str, timeout: float = 900) -> None:
    """Until the server's background compile is done: start-up's cost is not the hostile
    requests' (it runs once, and would fall in one timed phase and not the other)."""
    deadline = time.monotonic() + timeout
    while metrics(base, key=KEY).get("pagedjax_background_compile_pending", 0) > 0:
        assert time.monotonic() < deadline, "the background compile did not finish"
        time.sleep(1)


def compilations(base: str) -> float:
    m = metrics(base, key=KEY)
    return m.get("pagedjax_compilations_total", m.get("pagedjax_compilations", -1.0))
