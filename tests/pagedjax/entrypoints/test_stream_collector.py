"""A stream's handler reads what arrived for its requests since it last looked, each request's
latest output alone (vLLM's RequestOutputCollector): a handler that falls behind its engine sends
the tokens of several steps in one event, and nothing is lost or sent twice."""

from __future__ import annotations

import asyncio
import json
import threading
import types

import pytest
from server_helpers import KEY, MODEL, byte_llm, live_server, wait_idle
from test_final_only import BODY, NUM_TOKENS, post, stream_text

from pagedjax import SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.protocol import APIError
from pagedjax.entrypoints.openai.responses import StreamEvents
from pagedjax.entrypoints.openai.serving_engine import OpenAIServing, _Job, _Wakeups
from pagedjax.outputs import CompletionOutput, RequestOutput


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = byte_llm(tmp_path_factory, "collector")
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    ref = llm.generate([BODY["prompt"]], params)[0].outputs[0]
    with live_server(build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))) as base:
        yield base, ref


def test_a_stream_that_falls_behind_sends_the_latest_output_whole(served, monkeypatch):
    base, ref = served
    wait_idle(base)
    entered, release = threading.Event(), threading.Event()
    seen = []  # the tokens of each output the handler turned into events
    original = StreamEvents.events

    def held(self, out):
        seen.append(len(out.outputs[0].token_ids))
        if len(seen) == 1:  # the first output: hold its handler until the engine is done
            entered.set()
            release.wait(60)
        return original(self, out)

    monkeypatch.setattr(StreamEvents, "events", held)
    result = {}
    body = {**BODY, "stream": True, "logprobs": 1}
    worker = threading.Thread(target=lambda: result.update(reply=post(base, body)))
    worker.start()
    try:
        assert entered.wait(60), "the stream never reached its first output"
        wait_idle(base)  # every token generated while the handler was held
    finally:
        release.set()
        worker.join(60)
    status, reply = result["reply"]
    assert status == 200, reply[:300]
    # the rest arrived as one output (or all of it, if the engine finished before the first read)
    assert len(seen) <= 2 and seen[-1] == NUM_TOKENS
    assert stream_text(reply) == ref.text
    events = [line[6:] for line in reply.decode().splitlines() if line.startswith("data: {")]
    tokens = [t for e in events for t in (json.loads(e)["choices"][0]["logprobs"] or {})["tokens"]]
    assert len(tokens) == NUM_TOKENS  # every token's logprobs, each once


def output(rid: str, ids: list[int], error: str | None = None) -> RequestOutput:
    finish = "abort" if error else None
    c = CompletionOutput(0, "x" * len(ids), ids, None, None, finish)
    return RequestOutput(rid, None, [1], [c], error is not None, error)


def read_all(items: list, coalesce: bool = True) -> list:
    """What successive handler reads return after ``items`` arrived from the engine thread (an
    APIError's code for a read that raised)."""

    async def run():
        job = _Job(asyncio.get_running_loop(), coalesce)
        job.request_ids = sorted({x.request_id for x in items if isinstance(x, RequestOutput)})
        sender = threading.Thread(target=lambda: [job.sink(x) for x in items])
        sender.start()
        sender.join()
        serving = types.SimpleNamespace(check_engine_thread=lambda: None)

        async def gone():  # once nothing is left to read
            return True

        request = types.SimpleNamespace(is_disconnected=gone)
        reads = []
        while True:
            try:
                got = await OpenAIServing.next_outputs(serving, request, job)
            except APIError as e:
                return [*reads, e.body()["error"]["code"]]
            if got is None:
                return reads
            reads.append([(x.request_id, x.outputs[0].token_ids) for x in got])

    return asyncio.run(run())


def test_each_request_latest_output_in_arrival_order():
    items = [output("a", [5]), output("b", [6]), output("a", [5, 7]), output("a", [5, 7, 8])]
    assert read_all(items) == [[("a", [5, 7, 8]), ("b", [6])]]
    # outputs that are not cumulative are all kept
    assert read_all(items, coalesce=False) == [
        [("a", [5]), ("b", [6]), ("a", [5, 7]), ("a", [5, 7, 8])]
    ]


def test_the_outputs_before_a_failure_are_read_before_it():
    items = [output("a", [5]), output("b", [6], error="boom"), output("a", [5, 7])]
    assert read_all(items) == [[("a", [5, 7])], "request_failed"]
    items = [output("a", [5]), RuntimeError("step failed")]
    assert read_all(items) == [[("a", [5])], "engine_error"]


def test_one_call_into_the_event_loop_wakes_every_handler_of_a_pass():
    """The engine thread delivers a step's outputs to 64 streams: one call_soon_threadsafe (a
    write to the loop's self-pipe, a callback) wakes all their handlers, each of which reads its
    own output."""

    async def run():
        loop = asyncio.get_running_loop()
        calls = []

        class Counting:  # the loop, counting the calls from other threads
            def call_soon_threadsafe(self, fn, *args):
                calls.append(fn)
                return loop.call_soon_threadsafe(fn, *args)

        wakeups = _Wakeups(loop)
        wakeups.loop = Counting()
        jobs = [_Job(loop, True, wakeups) for _ in range(64)]
        for i, job in enumerate(jobs):
            job.request_ids = [f"r{i}"]
        sender = threading.Thread(
            target=lambda: [job.sink(output(f"r{i}", [i])) for i, job in enumerate(jobs)]
        )
        sender.start()
        sender.join()  # the loop runs nothing meanwhile: every wake-up waits for the one call
        reads = await asyncio.gather(*(job.wait(5.0) for job in jobs))
        return len(calls), [[(x.request_id, x.outputs[0].token_ids) for x in r] for r in reads]

    num_calls, reads = asyncio.run(run())
    assert num_calls == 1
    assert reads == [[(f"r{i}", [i])] for i in range(64)]
