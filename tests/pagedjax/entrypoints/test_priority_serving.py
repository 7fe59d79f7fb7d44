"""vLLM's priority scheduling end to end: ``LLM(scheduling_policy="priority")`` with
``generate(priority=[...])``, the HTTP field ``priority``, and an interactive request that
outranks a long one running alone (max_num_seqs=1) preempting it, then both finishing with the
text they have without preemption. An fcfs engine refuses a priority other than 0 (a 400 naming
the field), as vLLM does."""

from __future__ import annotations

import http.client
import json
import types

import pytest
from server_helpers import KEY, assert_openai_error, live_server, make_byte_model, raw

from pagedjax import LLM, SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

MODEL = "tiny-bytes"
LONG = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("priority_bytes")
    make_byte_model(path)
    return str(path)


@pytest.fixture(scope="module")
def served(model_dir):
    llm = LLM(
        model_dir,
        block_size=8,
        num_blocks=200,
        max_model_len=96,
        max_num_seqs=1,
        seed=0,
        scheduling_policy="priority",
    )
    outs = llm.generate(["batch", "user", "other"], SHORT, use_tqdm=False, priority=[5, -2, 0])
    refs = {p: llm.generate([p], LONG, use_tqdm=False)[0].outputs[0].text for p in ("bg", "hi")}
    app = build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base, offline=outs, refs=refs, llm=llm)


def test_offline_requests_start_in_priority_order(served):
    first = [o.metrics.first_token_time for o in served.offline]
    assert first[1] < first[2] < first[0]  # -2, then 0, then 5: one at a time (max_num_seqs=1)
    scheduled = [o.metrics.first_scheduled_time for o in served.offline]
    assert scheduled[1] < scheduled[2] < scheduled[0]
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        served.llm.generate(["a", "b"], SHORT, use_tqdm=False, priority=[1])


def test_an_fcfs_engine_refuses_a_priority_offline_and_over_http(model_dir):
    llm = LLM(model_dir, block_size=8, num_blocks=64, max_model_len=96, seed=0)
    with pytest.raises(ValueError, match="priority=3 needs the priority scheduling policy"):
        llm.generate(["a"], SHORT, use_tqdm=False, priority=[3])
    assert llm.generate(["a"], SHORT, use_tqdm=False, priority=[0])[0].outputs[0].token_ids
    with live_server(build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))) as base:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "priority": 3}
        status, reply = raw(base, "POST", "/v1/completions", body)
        assert_openai_error(status, reply, 400, param="priority", contains="priority=3")
        status, reply = raw(base, "POST", "/v1/completions", {**body, "priority": "high"})
        assert_openai_error(status, reply, 400, param="priority")


def _metric(base: str, name: str) -> float:
    status, body = raw(base, "GET", "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_an_interactive_request_preempts_a_long_one_of_lower_priority(served):
    base = served.base
    preemptions = _metric(base, "vllm:num_preemptions_total")
    port = int(base.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {
        "model": MODEL,
        "prompt": "bg",
        "max_tokens": 80,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "priority": 10,
    }
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()  # the long request is running: its first event is out
    assert first.startswith(b"data: ")
    urgent = {"model": MODEL, "prompt": "hi", "max_tokens": 80, "temperature": 0}
    status, reply = raw(base, "POST", "/v1/completions", {**urgent, "ignore_eos": True})
    assert status == 200
    assert json.loads(reply)["choices"][0]["text"] == served.refs["hi"]
    # the long one had to give way (only one sequence runs at a time) and still runs
    assert _metric(base, "vllm:num_preemptions_total") == preemptions + 1
    text = first.decode()
    for line in resp:
        text += line.decode()
    conn.close()
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == served.refs["bg"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
