"""The engine in a process of its own (``pagedjax serve --engine-process``): the same answers as
the in-thread server, client disconnects and aborts reaching the engine process, /metrics read
from it, named commands crossing with their errors, a SIGTERM finishing open streams, and a dead
engine process turned into the dead engine thread's errors."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hf_models import make_tiny_model
from peft_adapters import save_random_adapter
from server_helpers import (
    CHAT_TEMPLATE,
    KEY,
    MODEL,
    assert_openai_error,
    free_port,
    live_server,
    make_byte_model,
    raw,
    save_byte_tokenizer,
    sse_events,
    wait_idle,
)

from pagedjax import LLM, EngineArgs, LoRARequest, SamplingParams
from pagedjax.engine.hosting.engine_client import EngineProcess
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.engine.hosting.startup import EngineOptions
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.lora.updates import LoRAUpdates

ENGINE_ARGS = dict(block_size=8, num_blocks=200, seed=0, max_model_len=96, max_num_seqs=8)
PROMPTS = ["Hello there", "caf\u00e9 au lait", "abc"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-process")
    make_byte_model(path)
    return path


@pytest.fixture(scope="module")
def process_server(model_dir):
    """A server whose engine runs in a process of its own: (base URL, EngineProcess)."""
    args = EngineArgs(model=str(model_dir), **ENGINE_ARGS)
    options = EngineOptions(args, max_queue=8, background_compile=False)
    process = EngineProcess(options)
    try:
        assert process.wait_ready()
        app = build_app(process, MODEL, AppOptions(api_key=KEY))
        with live_server(app) as base:
            yield base, process
    finally:
        if process.process.is_alive():
            process.stop()


@pytest.fixture(scope="module")
def thread_server(model_dir):
    """The same model served with the engine on a thread of the server's process."""
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    with live_server(build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))) as base:
        yield base


def completion(base, **body):
    return raw(base, "POST", "/v1/completions", {"model": MODEL, **body}, timeout=120)


def answers(base) -> list:
    """Greedy streams, a chat, a constrained choice and echoed logprobs, as their texts."""
    out = []
    for prompt in PROMPTS:
        body = dict(prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True, stream=True)
        status, reply = completion(base, **body)
        assert status == 200, reply[:300]
        events = sse_events(reply)
        out.append("".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    status, reply = raw(base, "POST", "/v1/chat/completions", chat | {"temperature": 0})
    assert status == 200, reply[:300]
    out.append(json.loads(reply)["choices"][0]["message"]["content"])
    choice = {"choice": ["yes", "no", "maybe"]}
    status, reply = completion(base, prompt="Hi", max_tokens=4, structured_outputs=choice)
    assert status == 200, reply[:300]
    out.append(json.loads(reply)["choices"][0]["text"])
    status, reply = completion(
        base, prompt="Hi", max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    assert status == 200, reply[:300]
    out.append(json.loads(reply)["choices"])
    # several prompts in one request (one add message), a constrained pair among them
    status, reply = completion(base, prompt=PROMPTS, max_tokens=5, temperature=0, ignore_eos=True)
    assert status == 200, reply[:300]
    out.append([c["text"] for c in json.loads(reply)["choices"]])
    status, reply = completion(base, prompt=["Hi", "Yo"], max_tokens=4, structured_outputs=choice)
    assert status == 200, reply[:300]
    out.append([c["text"] for c in json.loads(reply)["choices"]])
    return out


def test_answers_equal_the_in_thread_servers(process_server, thread_server):
    base, _ = process_server
    assert answers(base) == answers(thread_server)


def test_refusals_equal_the_in_thread_servers(process_server, thread_server):
    base, _ = process_server
    bodies = [
        dict(prompt="x" * 200, max_tokens=4),  # past max_model_len: the admission check
        dict(prompt="Hi", structured_outputs={"regex": "(a{1000}){1000}"}),  # grammar limits
        dict(prompt=[1, 2, 999], max_tokens=4),  # outside the vocabulary
    ]
    for body in bodies:
        got, want = completion(base, **body), completion(thread_server, **body)
        assert got[0] == want[0] == 400, (got, want)
        assert json.loads(got[1]) == json.loads(want[1])


def test_metrics_are_the_engine_processs(process_server):
    base, _ = process_server
    before = wait_idle(base, key=KEY)
    status, reply = completion(base, prompt="abc", max_tokens=7, temperature=0, ignore_eos=True)
    assert status == 200, reply[:300]
    after = wait_idle(base, key=KEY)
    assert (
        after["pagedjax_generation_tokens_total"] - before["pagedjax_generation_tokens_total"] == 7
    )
    assert after["pagedjax_prompt_tokens_total"] - before["pagedjax_prompt_tokens_total"] == 3
    assert after["pagedjax_startup_programs"] > 0  # the start's figures, from the engine process
    assert after["pagedjax_kv_blocks_used"] == 0
    # vLLM's names, labelled with the served name the API process sent at start
    vllm = f'{{engine="0",model_name="{MODEL}"}}'
    gen = "vllm:generation_tokens_total" + vllm
    assert after[gen] - before[gen] == 7
    e2e = "vllm:e2e_request_latency_seconds_count" + vllm
    assert after[e2e] - before[e2e] == 1


def open_stream(base: str):
    """(connection, response) of an 80-token greedy stream, its body not yet read."""
    port = int(base.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 80, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    return conn, conn.getresponse()


def test_a_client_that_leaves_aborts_its_request_in_the_engine_process(process_server):
    base, _ = process_server
    before = wait_idle(base, key=KEY)
    key = 'pagedjax_request_success_total{finished_reason="abort"}'
    conn, resp = open_stream(base)
    assert resp.status == 200
    resp.read1(64)
    conn.close()
    after = wait_idle(base, key=KEY)  # running 0 and the KV pool empty, long before 80 tokens
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert (
        after["pagedjax_generation_tokens_total"] - before["pagedjax_generation_tokens_total"] < 80
    )


def test_named_commands_cross_with_their_errors(process_server):
    _, process = process_server
    with pytest.raises(ValueError, match="unknown engine command"):
        process.command("close")
    with pytest.raises(ValueError):  # an engine without LoRA refuses, here as in-thread
        process.command("remove_lora", 1).result(timeout=60)


def save_adapter(hf, directory, seed: int) -> str:
    """A PEFT adapter with random A and B on ``hf``'s attention; its directory."""
    save_random_adapter(hf, directory, seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return str(directory)


def test_lora_adapters_load_and_unload_through_named_commands(tmp_path):
    base = tmp_path / "base"
    hf = make_tiny_model("llama_gqa", base, vocab_size=260, bos_token_id=256, eos_token_id=257)
    save_byte_tokenizer(base, CHAT_TEMPLATE)
    paths = [save_adapter(hf, tmp_path / f"adapter{i}", seed=i) for i in (1, 2)]
    args = ENGINE_ARGS | dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    llm = LLM(str(base), **args)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    loras = {"base": None, "one": LoRARequest("one", 1, paths[0])}
    loras["two"] = LoRARequest("two", 2, paths[1])
    want = {
        name: llm.generate(["Hello"], params, lora_request=lora, use_tqdm=False)[0].outputs[0].text
        for name, lora in loras.items()
    }
    assert len(set(want.values())) == 3  # each adapter changes the text
    engine_args = EngineArgs(model=str(base), **args)
    process = EngineProcess(EngineOptions(engine_args, max_queue=8, background_compile=False))
    try:
        assert process.wait_ready()
        updates = LoRAUpdates(enabled=True)
        app = build_app(
            process, "base", AppOptions(lora_modules=[("one", paths[0])], lora_updates=updates)
        )
        with live_server(app) as url:
            load = {"lora_name": "two", "lora_path": paths[1]}
            assert raw(url, "POST", "/v1/load_lora_adapter", load, key=None)[0] == 200
            bad = {"lora_name": "three", "lora_path": str(tmp_path / "missing")}
            status, reply = raw(url, "POST", "/v1/load_lora_adapter", bad, key=None)
            assert_openai_error(status, reply, 400, param="lora_path")
            for name in ("one", "base", "two"):
                body = {"model": name, "prompt": "Hello", "max_tokens": 10, "temperature": 0}
                status, reply = raw(url, "POST", "/v1/completions", body | {"ignore_eos": True})
                assert status == 200, reply[:300]
                assert json.loads(reply)["choices"][0]["text"] == want[name], name
            unload = {"lora_name": "two"}
            assert raw(url, "POST", "/v1/unload_lora_adapter", unload, key=None)[0] == 200
            body = {"model": "two", "prompt": "Hello", "max_tokens": 2}
            assert raw(url, "POST", "/v1/completions", body, key=None)[0] == 404
    finally:
        process.stop()


def test_an_engine_that_cannot_start_raises_naming_why(tmp_path):
    args = EngineArgs(model=str(tmp_path / "missing"))
    process = EngineProcess(EngineOptions(args, max_queue=8))
    with pytest.raises(RuntimeError, match="the engine process could not start"):
        process.wait_ready()
    process.stop()
    assert not process.process.is_alive()


def test_a_dead_engine_process_fails_streams_health_and_new_requests(process_server):
    """Last in this file: it kills the module's engine process."""
    base, process = process_server
    conn, resp = open_stream(base)
    first = resp.read1(64)
    assert resp.status == 200 and first
    os.kill(process.process.pid, signal.SIGKILL)
    events = sse_events(first + resp.read())
    conn.close()
    assert events[-1] == "[DONE]"
    assert "the engine thread has stopped" in events[-2]["error"]["message"], events[-2]
    assert raw(base, "GET", "/health", key=None)[0] == 503
    status, reply = completion(base, prompt="Hi", max_tokens=4)
    err = assert_openai_error(status, reply, 500, contains="the engine thread has stopped")
    assert err["code"] == "engine_error"


def test_sigterm_finishes_open_streams_and_stops_the_engine_process(model_dir, tmp_path):
    port = free_port()
    argv = [sys.executable, "-c", "from pagedjax.cli import main; main()", "serve"]
    argv += ["--model", str(model_dir), "--port", str(port), "--api-key", KEY, "--engine-process"]
    argv += ["--served-model-name", MODEL, "--block-size", "8", "--num-blocks", "200"]
    argv += ["--max-model-len", "96", "--no-background-compile"]
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no /health"
                try:
                    if raw(base, "GET", "/health", key=None, timeout=5)[0] == 200:
                        break
                except OSError:
                    time.sleep(0.5)
            # the engine process and the body-check worker (openai/body_check.py)
            spawned = [c for c in _children(proc.pid) if b"spawn_main" in _cmdline(c)]
            assert len(spawned) == 2, spawned
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 60, "ignore_eos": True}
            headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}), headers)
            resp = conn.getresponse()
            first = resp.read1(64)
            proc.send_signal(signal.SIGTERM)
            events = sse_events(first + resp.read())
            conn.close()
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    assert sum(len(e["choices"][0]["text"]) for e in events[:-1] if e["choices"]) > 0
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert not any(_alive(c) for c in spawned)  # the engine process stopped too, the worker


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]
