"""`pagedjax bench serve`: the client against a live pagedjax server (tiny random model), against
stub servers that fail in every way (counted, never fatal), and the comparison / sweep logic with
stub peer processes. Timings here are meaningless; the assertions are on counts and shapes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hf_models import tiny_llama_dir
from server_helpers import free_port, live_server, save_byte_tokenizer

from pagedjax import LLM
from pagedjax.bench import serve_metrics, serve_peers, serve_workload
from pagedjax.cli import main
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app

MODEL = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}w10 {{ m['content'] }} {% endfor %}w12"

# An OpenAI-like server in the standard library only (a stub peer starts in milliseconds).
# Each generated token is the word "w5 "; no usage unless --usage. --mode: ok; errors (of the
# timed requests, by arrival: an HTTP 500, an error event mid-stream, a success, in turn);
# refuse-eos (422 naming ignore_eos / min_tokens, like transformers serve); exit (dies at once).
STUB = textwrap.dedent(
    """
    import argparse, itertools, json, signal, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--usage", action="store_true")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--record", default=None)
    ap.add_argument("--requests", default=None)  # a JSON line per request: size, in flight, prompt
    a = ap.parse_args()
    if a.mode == "exit":
        print("stub: refusing to start", flush=True)
        sys.exit(3)
    counter, lock = itertools.count(), threading.Lock()
    in_flight = [0]

    def record(what):
        if a.record:
            with lock, open(a.record, "a") as f:
                f.write(f"{what} {a.port} {time.time()}\\n")

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, status, body, ctype="application/json"):
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self.reply(200, "ok", "text/plain")
            self.reply(200, json.dumps({"data": [{"id": "stub-model"}]}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                in_flight[0] += 1
                if a.requests:
                    n = body.get("max_tokens") or body.get("max_completion_tokens")
                    line = {"n": n, "in_flight": in_flight[0], "prompt": body.get("prompt")}
                    with open(a.requests, "a") as f:
                        f.write(json.dumps(line) + "\\n")
            try:
                self.answer(body)
            finally:
                with lock:
                    in_flight[0] -= 1

        def answer(self, body):
            if a.mode == "refuse-eos":
                bad = {"ignore_eos", "min_tokens"} & set(body)
                if bad:
                    return self.reply(422, json.dumps({"detail": f"Unexpected fields: {bad}"}))
            n = body.get("max_tokens") or body.get("max_completion_tokens")
            kind = "ok"
            if a.mode == "errors" and n != 2:  # the probe asks for 2 tokens
                kind = ("http500", "event", "ok")[next(counter) % 3]
            if kind == "http500":
                err = {"error": {"message": "stub overloaded", "type": "server_error"}}
                return self.reply(500, json.dumps(err))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            chat = "messages" in body
            for i in range(n):
                if kind == "event" and i == 1:
                    self.event({"error": {"message": "stub failed mid-stream"}})
                    break
                time.sleep(a.delay)
                c = {"delta": {"content": "w5 "}} if chat else {"text": "w5 "}
                self.event({"choices": [{"index": 0, **c, "finish_reason": None}]})
            if a.usage:
                self.event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})
            self.wfile.write(b"data: [DONE]\\n\\n")
            self.close_connection = True

        def event(self, obj):
            self.wfile.write(f"data: {json.dumps(obj)}\\n\\n".encode())
            self.wfile.flush()

    srv = ThreadingHTTPServer(("127.0.0.1", a.port), H)
    record("start")

    def stop(*_):
        record("stop")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    srv.serve_forever()
    """
)


@pytest.fixture(scope="module")
def stub_script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stub") / "stub_server.py"
    path.write_text(STUB)
    return str(path)


def stub_command(script: str, *flags: str) -> str:
    return f"{sys.executable} {script} --port {{port}} " + " ".join(flags)


class StubServer:
    """One stub process on a free port, for the single-server tests."""

    def __init__(self, script: str, *flags: str):
        self.port = free_port()
        argv = [sys.executable, script, "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(argv)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None
                time.sleep(0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return tiny_llama_dir(tmp_path_factory, "serve_tiny", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(tiny_dir):
    llm = LLM(tiny_dir, block_size=8, num_blocks=256, max_model_len=128, seed=0)
    with live_server(build_app(EngineLoop(llm.engine), MODEL)) as base:
        yield base
    llm.close()


def bench_json(capsys, *argv: str) -> dict:
    assert main(["bench", "serve", "--disable-tqdm", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


# ---- against pagedjax serve -----------------------------------------------------------------


def test_completions_exact_lengths_and_an_slo_everyone_meets(server, tiny_dir, capsys):
    res = bench_json(
        capsys,
        *("--base-url", server, "--model", MODEL, "--tokenizer", tiny_dir),
        *("--dataset-name", "random", "--random-input-len", "12", "--random-output-len", "6"),
        *("--num-prompts", "6", "--max-concurrency", "3", "--num-warmups", "1"),
        *("--slo", "ttft=600000,tpot=600000,e2el=600000"),
    )
    (srv,) = res["servers"]
    assert set(srv["fields_sent"]) == {"ignore_eos", "min_tokens", "stream_options"}
    assert not srv["fields_refused"]
    assert srv["warmup"]["num"] == 1 and srv["warmup"]["failed"] == 0
    (row,) = res["rows"]
    assert (row["completed"], row["failed"], row["exact_lengths"]) == (6, 0, 6)
    assert row["total_input_tokens"] == 6 * 12 and row["total_output_tokens"] == 6 * 6
    assert row["good_requests"] == 6 and row["goodput"] == pytest.approx(row["request_throughput"])
    for key in serve_metrics.LATENCIES:
        assert 0 < row[key]["median"] <= row[key]["p99"], key
    assert row["output_throughput"] == pytest.approx(36 / row["duration_s"])


def test_chat_sharegpt_like_at_a_bursty_rate_with_an_slo_nobody_meets(server, tiny_dir, capsys):
    res = bench_json(
        capsys,
        *("--base-url", server, "--tokenizer", tiny_dir, "--endpoint", "/v1/chat/completions"),
        *("--dataset-name", "sharegpt-like", "--max-prompt-len", "16", "--max-output-len", "5"),
        *("--num-prompts", "5", "--request-rate", "40", "--burstiness", "0.5"),
        *("--num-warmups", "0", "--slo", "ttft=0.001"),
    )
    assert res["servers"][0]["model"] == MODEL  # asked of /v1/models
    (row,) = res["rows"]
    assert (row["completed"], row["exact_lengths"], row["good_requests"]) == (5, 5, 0)
    assert row["request_rate"] == 40 and row["burstiness"] == 0.5


def test_json_dataset_and_the_printed_report(server, tiny_dir, tmp_path, capsys):
    data = tmp_path / "requests.json"
    items = [
        {"prompt": "w5 w6 w7", "output_len": 3},
        {"prompt": [8, 9, 10, 11], "output_len": 2},
        {"conversations": [{"from": "human", "value": "w20 w21"}, {"value": "w3 w4 w5 w6"}]},
    ]
    data.write_text(json.dumps(items))
    argv = ["bench", "serve", "--base-url", server, "--model", MODEL, "--tokenizer", tiny_dir]
    argv += ["--dataset-name", "json", "--dataset-path", str(data), "--disable-tqdm"]
    argv += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "result.json").read_text())["completed"] == 3
    assert "Serving benchmark" in out and "warm-up (excluded): 2 requests" in out
    lines = dict(line.rsplit(None, 1) for line in out.splitlines() if line.count(" ") > 3)
    assert lines["successful requests"] == "3" and lines["exact output lengths"] == "3/3"
    assert lines["total input tokens"] == "9" and lines["total output tokens"] == "9"


# ---- stubs: errors, refused fields ----------------------------------------------------------


def test_errors_are_counted_with_their_messages_never_fatal(stub_script, tiny_dir, capsys):
    with StubServer(stub_script, "--mode", "errors") as stub:
        res = bench_json(
            capsys,
            *("--base-url", stub.base, "--tokenizer", tiny_dir, "--num-warmups", "0"),
            *("--dataset-name", "random", "--random-input-len", "4", "--random-output-len", "3"),
            *("--num-prompts", "6", "--max-concurrency", "1", "--max-failure-rate", "1"),
        )
    (row,) = res["rows"]
    assert (row["completed"], row["failed"]) == (2, 4)
    assert row["errors"] == {
        "HTTP 500: stub overloaded": 2,
        "error event: stub failed mid-stream": 2,
    }
    assert row["total_output_tokens"] == 6 and row["exact_lengths"] == 2  # no usage: tokenized


def test_a_server_refusing_ignore_eos_is_named_with_the_way_round(stub_script, tiny_dir, capsys):
    with StubServer(stub_script, "--mode", "refuse-eos", "--usage") as stub:
        argv = ["bench", "serve", "--base-url", stub.base, "--tokenizer", tiny_dir, "--json"]
        argv += ["--num-prompts", "2", "--max-output-len", "4", "--disable-tqdm"]
        assert main(argv) == 0
    captured = capsys.readouterr()
    srv = json.loads(captured.out)["servers"][0]
    assert srv["fields_sent"] == ["stream_options"]
    assert set(srv["fields_refused"]) == {"ignore_eos", "min_tokens"}
    assert "refuses ignore_eos" in captured.err and "--disable-eos-copy" in captured.err
    assert srv["rows"][0]["failed"] == 0


def test_an_unreachable_server_is_a_usage_error(tiny_dir, capsys):
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m"]
    assert main([*argv, "--tokenizer", tiny_dir, "--num-prompts", "1", "--disable-tqdm"]) == 2
    assert "cannot reach" in capsys.readouterr().err


# ---- started servers: comparison and sweep --------------------------------------------------


def test_compare_two_stub_peers_one_at_a_time_with_a_sweep(stub_script, tiny_dir, tmp_path, capsys):
    record = tmp_path / "record.txt"
    plot = tmp_path / "sweep.png"
    res = bench_json(
        capsys,
        *("--no-pagedjax", "--model", tiny_dir, "--log-dir", str(tmp_path / "logs")),
        "--peer",
        "fast=" + stub_command(stub_script, "--usage", "--record", str(record)),
        "--peer",
        "slow=" + stub_command(stub_script, "--delay", "0.01", "--record", str(record)),
        *("--sweep-concurrency", "1,3", "--plot", str(plot), "--num-warmups", "1"),
        *("--dataset-name", "random", "--random-input-len", "5", "--random-output-len", "4"),
        *("--num-prompts", "3"),
    )
    assert [(r["server"], r["max_concurrency"]) for r in res["rows"]] == [
        ("fast", 1),
        ("fast", 3),
        ("slow", 1),
        ("slow", 3),
    ]
    assert all(r["completed"] == 3 and r["exact_lengths"] == 3 for r in res["rows"])
    events = [line.split()[0] for line in record.read_text().splitlines()]
    assert events == ["start", "stop", "start", "stop"]  # never two servers at once
    assert plot.stat().st_size > 0
    assert all(Path(s["log"]).exists() and s["ready_s"] >= 0 for s in res["servers"])


def test_compare_prints_side_by_side_and_survives_a_peer_that_dies(
    stub_script, tiny_dir, tmp_path, capsys
):
    argv = ["bench", "serve", "--no-pagedjax", "--model", tiny_dir, "--disable-tqdm"]
    argv += ["--peer", "a=" + stub_command(stub_script, "--usage")]
    argv += ["--peer", "dead=" + stub_command(stub_script, "--mode", "exit")]
    argv += ["--peer", "b=" + stub_command(stub_script, "--delay", "0.005")]
    argv += ["--num-prompts", "2", "--max-output-len", "3", "--log-dir", str(tmp_path)]
    assert main(argv) == 1  # a server did not start
    captured = capsys.readouterr()
    assert "exited with code 3" in captured.err and "refusing to start" in captured.err
    header = next(line for line in captured.out.splitlines() if "a/b" in line)
    assert header.split() == ["a", "b", "a/b"]
    assert "dead: did not start" in captured.out


@pytest.mark.slow  # starts `pagedjax serve` as a process (load, warm-up compilation)
def test_compare_starts_pagedjax_serve_and_a_peer(stub_script, tiny_dir, tmp_path, capsys):
    res = bench_json(
        capsys,
        *("--model", tiny_dir, "--max-model-len", "128", "--log-dir", str(tmp_path)),
        *("--server-args", "pagedjax=--max-num-seqs 4 --num-blocks 64"),
        *("--peer", "stub=" + stub_command(stub_script, "--usage")),
        *("--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "5"),
        *("--num-prompts", "4", "--max-concurrency", "2"),
    )
    assert [s["server"] for s in res["servers"]] == ["pagedjax", "stub"]
    assert "--max-num-seqs 4" in res["servers"][0]["command"]
    assert all(r["completed"] == 4 and r["exact_lengths"] == 4 for r in res["rows"])


def test_repeats_and_fewer_prompts_at_the_small_sweep_values(server, tiny_dir, capsys, tmp_path):
    res = bench_json(
        capsys,
        *("--base-url", server, "--model", MODEL, "--tokenizer", tiny_dir),
        *("--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4"),
        *("--num-prompts", "4", "--sweep-concurrency", "1,2", "--sweep-num-prompts", "2,4"),
        *("--repeats", "3", "--num-warmups", "0", "--plot", str(tmp_path / "sweep.png")),
    )
    assert [(r["max_concurrency"], r["completed"]) for r in res["rows"]] == [(1, 2), (2, 4)]
    for row in res["rows"]:
        assert row["failed"] == 0 and row["exact_lengths"] == row["completed"]
        rep = row["repeats"]
        assert rep["runs"] == 3 and len(rep["output_throughput"]) == 3
        assert rep["min"] <= rep["median"] <= rep["max"]
        assert row["output_throughput"] == sorted(rep["output_throughput"])[1] == rep["median"]


def test_each_repeat_draws_its_own_prompts_of_the_same_lengths(tiny_dir):
    from pagedjax.bench import serve

    argv = ["--dataset-name", "random", "--random-input-len", "9", "--num-prompts", "3"]
    args = serve.build_parser().parse_args([*argv, "--repeats", "2"])
    first, second = serve.build_workloads(args, serve_workload.load_tokenizer(tiny_dir))
    assert [r.prompt_len for r in first] == [r.prompt_len for r in second] == [9, 9, 9]
    assert not {r.prompt for r in first} & {r.prompt for r in second}


def test_pick_median_run_keeps_the_middle_run_and_the_spread():
    runs = [{"output_throughput": x, "tag": i} for i, x in enumerate((3.0, 1.0, 2.0, 4.0))]
    row = serve_metrics.pick_median_run(runs)
    assert row["tag"] == 2  # the lower of the middle two
    assert row["repeats"] == {
        "runs": 4,
        "output_throughput": [3.0, 1.0, 2.0, 4.0],
        "min": 1.0,
        "median": 2.5,
        "max": 4.0,
    }
    with pytest.raises(ValueError, match="at least one run"):
        serve_metrics.pick_median_run([])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sweep-concurrency", "1,2", "--sweep-num-prompts", "2"], "one count per sweep value"),
        (["--sweep-num-prompts", "2"], "one count per sweep value"),
        (["--sweep-concurrency", "1,2", "--sweep-num-prompts", "2,9"], "at most --num-prompts"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--start-pagedjax", "--no-pagedjax"], "contradict"),
    ],
)
def test_bad_sweep_prompts_repeats_or_servers_fail_before_a_start(tiny_dir, capsys, flags, message):
    argv = ["bench", "serve", "--model", tiny_dir, "--num-prompts", "4", "--disable-tqdm"]
    assert main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err


def test_server_specs_and_their_flags(tiny_dir):
    s = serve_peers.ServerSettings(tiny_dir, max_model_len=512, seed=3)
    spec = serve_peers.known_spec("pagedjax", s, ["--max-num-seqs", "8"])
    assert spec.argv[1:4] == ("-m", "pagedjax", "serve") and spec.request_model == tiny_dir
    assert "--max-model-len" in spec.argv and spec.argv[-2:] == ("--max-num-seqs", "8")
    gguf = serve_peers.ServerSettings("/w/m/SmolLM2.gguf")
    peer = serve_peers.known_spec("transformers", gguf, ["--cb-block-size", "32"])
    assert peer.argv[1:3] == ("serve", "--continuous-batching")
    assert peer.argv[-3:] == ("--cb-block-size", "32", "/w/m:SmolLM2.gguf")
    assert peer.request_model == "/w/m:SmolLM2.gguf"
    with pytest.raises(ValueError, match="unknown server"):
        serve_peers.known_spec("llamacpp", s, [])
    with pytest.raises(ValueError, match="must place"):
        serve_peers.custom_spec("x=python server.py", s)
    assert serve_peers.parse_server_args(["a=--x 1", "a=--y"]) == {"a": ["--x", "1", "--y"]}


def test_compare_with_transformers_on_a_gguf_asks_for_the_copy(capsys):
    argv = ["bench", "serve", "--compare", "transformers", "--model", "/nowhere/m.gguf"]
    assert main(argv) == 2
    assert "--disable-eos-copy" in capsys.readouterr().err


# ---- the EOS-free copy, the workload, the figures --------------------------------------------


def test_eos_free_copy_of_an_hf_directory_leaves_the_source_alone(tmp_path, capsys):
    src, dest = tmp_path / "src", tmp_path / "noeos"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 9}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (src / "model.safetensors").write_bytes(b"weights")
    argv = ["bench", "serve", "--disable-eos-copy", str(dest), "--model", str(src)]
    assert main(argv) == 0 and "wrote" in capsys.readouterr().out
    assert json.loads((dest / "config.json").read_text()) == {"eos_token_id": None, "vocab_size": 9}
    assert json.loads((dest / "generation_config.json").read_text())["eos_token_id"] is None
    assert json.loads((src / "config.json").read_text())["eos_token_id"] == 2
    assert (dest / "model.safetensors").read_bytes() == b"weights"
    assert main(argv) == 0 and "already there" in capsys.readouterr().out
    other = tmp_path / "other"
    other.mkdir()
    assert main(["bench", "serve", "--disable-eos-copy", str(dest), "--model", str(other)]) == 2
    assert "is a copy of" in capsys.readouterr().err


def test_random_prompts_have_exact_lengths_with_a_byte_level_tokenizer(tmp_path):
    """Random bytes decode to partial UTF-8 that re-encodes longer: the maker must still hit
    every length exactly."""
    from transformers import AutoTokenizer

    save_byte_tokenizer(tmp_path, "")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    maker = serve_workload.PromptMaker(tok, seed=0)
    wanted = [1, 2, 3, 7, 50, 200, 500] * 3
    assert [maker.make(n).prompt_len for n in wanted] == wanted
    reqs = serve_workload.random_requests(tok, 12, 64, 8, 0.5, seed=1)
    assert all(len(tok(r.prompt)["input_ids"]) == r.prompt_len for r in reqs)
    assert all(32 <= r.prompt_len <= 96 and 4 <= r.output_len <= 12 for r in reqs)


@pytest.mark.slow  # the GGUF tokenizer takes seconds to build
def test_random_prompts_have_exact_lengths_with_the_smollm2_tokenizer():
    from pagedjax.models.loader import default_model_path, gguf_tokenizer

    try:
        tok = gguf_tokenizer(default_model_path())
    except ValueError as e:  # the embedded model is not installed
        pytest.skip(str(e))
    maker = serve_workload.PromptMaker(tok, seed=0)
    wanted = [1, 2, 7, 64, 200, 2000] * 3
    assert [maker.make(n).prompt_len for n in wanted] == wanted


def test_arrivals_are_seeded_gamma_gaps():
    assert not serve_workload.arrival_times(5, float("inf"), 1.0, 0).any()
    t = serve_workload.arrival_times(4000, 20.0, 1.0, seed=0)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert np.diff(t).mean() == pytest.approx(1 / 20, rel=0.1)
    bursty = np.diff(serve_workload.arrival_times(4000, 20.0, 0.25, seed=0))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.15) and bursty.std() > np.diff(t).std()
    assert np.array_equal(t, serve_workload.arrival_times(4000, 20.0, 1.0, seed=0))
    with pytest.raises(ValueError, match="burstiness"):
        serve_workload.arrival_times(3, 1.0, 0.0, 0)


def test_slo_parsing():
    assert serve_metrics.parse_slo("ttft=500,tpot:50 e2el=2e3") == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.0,
    }
    for bad in ("ttft", "itl=5", "ttft=x", "tpot=-1"):
        with pytest.raises(ValueError, match="--slo"):
            serve_metrics.parse_slo(bad)


def test_each_sweep_value_warms_up_at_its_own_concurrency(stub_script, tiny_dir, tmp_path, capsys):
    log = tmp_path / "requests.jsonl"
    with StubServer(stub_script, "--usage", "--delay", "0.05", "--requests", str(log)) as stub:
        res = bench_json(
            capsys,
            *("--base-url", stub.base, "--tokenizer", tiny_dir, "--sweep-concurrency", "1,3"),
            *("--sweep-num-warmups", "1,3", "--num-prompts", "3"),
            *("--plot", str(tmp_path / "sweep.png")),  # not into the working directory
            *("--dataset-name", "random", "--random-input-len", "5", "--random-output-len", "4"),
        )
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    probe, sent = seen[0], seen[1:]
    assert probe["n"] == 2 and len(sent) == 1 + 3 + 3 + 3
    warm1, timed1, warm3, timed3 = sent[:1], sent[1:4], sent[4:7], sent[7:]
    assert max(r["in_flight"] for r in warm1 + timed1) == 1
    assert max(r["in_flight"] for r in warm3) == 3  # sent at once, the row's concurrency
    timed = sorted(r["prompt"] for r in timed1)
    assert sorted(r["prompt"] for r in timed3) == timed  # the workload's requests, at both values
    assert not {r["prompt"] for r in warm1 + warm3} & set(timed)  # prompts no timed run sends
    assert [r["warmup"]["num"] for r in res["rows"]] == [1, 3]
    assert res["servers"][0]["warmup"]["num"] == 1  # the first value's
    for bad in ("1", "1,-1", "1,x"):  # refused before any request is sent
        flags = ["--sweep-concurrency", "1,3", "--sweep-num-warmups", bad]
        assert main(["bench", "serve", "--base-url", stub.base, *flags]) == 2
        assert "--sweep-num-warmups" in capsys.readouterr().err


# ---- vLLM's flags and result file -----------------------------------------------------------

# The keys vLLM's own benchmark scripts read from a `vllm bench serve` result
# (.buildkite/nightly-benchmarks/scripts/convert-results-json-to-markdown.py's serving table)
VLLM_SERVING_KEYS = (
    "completed",
    "request_throughput",
    "total_token_throughput",
    "output_throughput",
    "total_input_tokens",
    "total_output_tokens",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "p99")),
)


def read_serving_results(folder: Path) -> list[dict]:
    """As vLLM's script: every *.json of the folder, the serving table's columns (a missing key
    is a KeyError, as pandas' column selection is)."""
    rows = []
    for test_file in sorted(folder.glob("*.json")):
        raw_result = json.loads(test_file.read_text())
        raw_result.update({"test_name": test_file.stem})
        rows.append({k: raw_result[k] for k in ("test_name", *VLLM_SERVING_KEYS)})
    return rows


def test_vllms_flags_write_the_result_file_vllms_scripts_read(server, tiny_dir, tmp_path):
    host, port = server.rsplit("/", 1)[1].split(":")
    argv = ["bench", "serve", "--backend", "openai", "--host", host, "--port", port]
    argv += ["--model", MODEL, "--tokenizer", tiny_dir, "--dataset-name", "random"]
    argv += ["--input-len", "10", "--output-len", "4", "--num-prompts", "5"]
    argv += ["--max-concurrency", "2", "--save-result", "--result-dir", str(tmp_path)]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    argv += ["--goodput", "ttft:600000", "e2el:600000", "--label", "pj", "--metadata", "tp=1"]
    assert main([*argv, "--disable-tqdm", "--num-warmups", "0"]) == 0
    (path,) = tmp_path.glob("*.json")
    assert re.fullmatch(rf"pj-infqps-concurrency2-{MODEL}-\d{{8}}-\d{{6}}\.json", path.name)
    (row,) = read_serving_results(tmp_path)
    assert row["completed"] == 5 and row["total_output_tokens"] == 5 * 4
    assert all(isinstance(row[k], int | float) for k in VLLM_SERVING_KEYS)
    data = json.loads(path.read_text())
    assert (data["backend"], data["label"], data["tp"], data["model_id"]) == (
        "openai",
        "pj",
        "1",
        MODEL,
    )
    assert (data["num_prompts"], data["max_concurrency"], data["request_rate"]) == (5, 2, "inf")
    assert data["input_lens"] == [10] * 5 and data["output_lens"] == [4] * 5
    assert len(data["ttfts"]) == 5 and all(len(itl) <= 3 for itl in data["itls"])  # events
    assert all(isinstance(t, str) for t in data["generated_texts"]) and data["errors"] == [""] * 5
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert data[f"p50_{m}_ms"] <= data[f"p90_{m}_ms"] <= data[f"p99_{m}_ms"], m
        assert data[f"std_{m}_ms"] >= 0
    assert data["median_e2el_ms"] == pytest.approx(1e3 * float(np.median(data["latencies"])))
    assert 1 <= data["max_concurrent_requests"] <= 2 and data["max_output_tokens_per_s"] >= 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "not the API of"),
        (["--goodput", "ttft:1", "--slo", "ttft=1"], "give --goodput"),
        (["--goodput", "latency:5"], "--goodput takes"),
        (["--percentile-metrics", "ttft,speed"], "--percentile-metrics takes"),
        (["--metric-percentiles", "0"], "--metric-percentiles takes"),
    ],
)
def test_vllms_flags_are_checked_before_anything_is_sent(tiny_dir, capsys, flags, message):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", tiny_dir]
    assert main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err
