"""A whole (non-streamed) answer asks the engine for its final output alone (vLLM's FINAL_ONLY):
no output is built at the steps in between, while a stream gets one per step; the answer, the
tokens generated and the time to first token on /metrics are what they were."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from server_helpers import KEY, MODEL, byte_llm, live_server, wait_idle

from pagedjax import SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

NUM_TOKENS = 20
BODY = {"model": MODEL, "prompt": "caf\u00e9 ", "max_tokens": NUM_TOKENS, "temperature": 0}
BODY["ignore_eos"] = True


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = byte_llm(tmp_path_factory, "final-only")
    ref = llm.generate(
        [BODY["prompt"]], SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    )[0]
    built = []  # the request id of every output the engine builds
    processor = llm.engine.request_table.output_processor
    make = processor.make_output
    processor.make_output = lambda req: built.append(req.request_id) or make(req)
    with live_server(build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))) as base:
        yield base, built, ref.outputs[0].text


def post(base: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


def stream_text(reply: bytes) -> str:
    events = [line[6:] for line in reply.decode().splitlines() if line.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")


def test_a_whole_answer_builds_one_output_and_a_stream_one_per_step(served):
    base, built, text = served
    before = wait_idle(base)
    start = len(built)
    t0 = time.monotonic()
    status, reply = post(base, BODY)
    latency = time.monotonic() - t0
    assert status == 200, reply[:300]
    assert json.loads(reply)["choices"][0]["text"] == text
    assert len(built) - start == 1  # the finished output alone
    after = wait_idle(base)
    tokens = "pagedjax_generation_tokens_total"
    assert after[tokens] - before[tokens] == NUM_TOKENS  # the engine's count, not the outputs'
    ttft = "pagedjax_time_to_first_token_seconds"
    assert after[f"{ttft}_count"] - before[f"{ttft}_count"] == 1
    # the engine's first token time, not the final output's arrival
    assert 0 < after[f"{ttft}_sum"] - before[f"{ttft}_sum"] < latency

    start = len(built)
    status, reply = post(base, {**BODY, "stream": True})
    assert status == 200 and stream_text(reply) == text
    assert len(built) - start >= NUM_TOKENS  # a stream's outputs, step by step
    later = wait_idle(base)
    assert later[tokens] - after[tokens] == NUM_TOKENS
