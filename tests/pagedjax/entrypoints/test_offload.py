"""The server's offload lanes: heavy and grammar work runs at a lower scheduling priority than the
light lane and the threads that call it (the engine's and the event loop's)."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

from pagedjax.entrypoints.openai.offload import Offload


def nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread priorities here")
def test_heavy_and_grammar_lanes_run_niced_the_light_lane_not():
    base = nice()
    if base >= 10:
        pytest.skip(f"this process already runs at nice {base}")
    offload = Offload(None)

    async def lanes():
        light = await offload.run(nice)
        grammar = await offload.run_grammar(nice)
        Offload.mark_heavy()
        heavy = await offload.run(nice)
        return light, heavy, grammar

    try:
        light, heavy, grammar = asyncio.run(lanes())
    finally:
        offload.close()
    assert (light, heavy, grammar) == (base, 10, 10)
    assert nice() == base  # the caller's own priority untouched


def test_a_small_body_runs_inline_a_larger_one_on_the_light_lane_a_huge_one_on_heavy():
    offload = Offload(None)
    caller = threading.get_ident()

    async def where(size: int) -> str:
        Offload.mark_body(size)  # each asyncio.run is a task of its own: its own mark
        ident, name = await offload.run(
            lambda: (threading.get_ident(), threading.current_thread().name)
        )
        return "inline" if ident == caller else name.rsplit("_", 1)[0]

    try:
        lanes = [asyncio.run(where(size)) for size in (200, 4096, 4097, 64 * 1024 + 1)]
    finally:
        offload.close()
    assert lanes == ["inline", "inline", "pagedjax-light", "pagedjax-heavy"]


def test_bodies_encode_as_compact_utf8_json():
    from pagedjax.entrypoints.openai.offload import dumps, dumps_bytes

    top = [{"caf\u00e9": -0.5, " x": -1.25e-05, "\u4e2d": -9999.0} for _ in range(2500)]
    body = {"id": "c-1", "choices": [{"logprobs": {"top_logprobs": top}, "index": 0}], 7: None}
    text = dumps(body)
    assert json.loads(text) == json.loads(json.dumps(body))  # int keys written as strings
    assert "caf\u00e9" in text and ", " not in text and ": " not in text  # UTF-8, compact
    assert dumps_bytes(body) == text.encode()


def test_a_stop_iteration_in_a_lane_is_an_error_not_a_request_waiting_forever():
    offload = Offload(None)

    async def call(run):
        return await asyncio.wait_for(run(next, iter(())), timeout=30)

    try:
        for run in (offload.run, offload.run_grammar):
            Offload.mark_body(8192)  # the light lane, not inline
            with pytest.raises(RuntimeError, match="StopIteration"):
                asyncio.run(call(run))
    finally:
        offload.close()
