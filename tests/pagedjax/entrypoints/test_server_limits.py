"""Server limits (issue 41): heavy work never holds the event loop, oversized responses are
refused up front, malformed logit_bias keys are 400s, streamed choices carry stop_reason.

The event-loop tests hold the heavy step (tokenizing, building a response, compiling a grammar)
open until /health has answered: /health can only answer if that step runs off the event loop.
"""

from __future__ import annotations

import json
import threading
import time
import types
import urllib.error

import pytest
from server_helpers import (
    assert_openai_error,
    byte_llm,
    live_server,
    raw,
    sse_events,
    wait_idle,
)

from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import ServerLimits, build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.logprobs import TokenStrings
from pagedjax.entrypoints.openai.serving_engine import OpenAIServing
from pagedjax.structured_output.grammar import GrammarCompiler

KEY = "limits-key"
MODEL = "tiny-limits"
MAX_MODEL_LEN = 96
MAX_RESPONSE_LOGPROBS = 5000
PROMPT = "Hello there"
GEN_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = byte_llm(tmp_path_factory, "limits_llama", max_model_len=MAX_MODEL_LEN)
    limits = ServerLimits(max_response_logprobs=MAX_RESPONSE_LOGPROBS)
    app = build_app(
        EngineLoop(llm.engine, limits.max_queue), MODEL, AppOptions(api_key=KEY, limits=limits)
    )
    with live_server(app) as base:
        yield types.SimpleNamespace(
            base=base, serving=app.state.serving_completion, engine=llm.engine
        )


def post(server, body: dict, path="/v1/completions", timeout=60):
    return raw(server.base, "POST", path, {"model": MODEL, **body}, key=KEY, timeout=timeout)


def health(server, timeout: float) -> bool:
    """Whether /health answered "ok" within ``timeout`` seconds."""
    try:
        status, body = raw(server.base, "GET", "/health", key=None, timeout=timeout)
    except (TimeoutError, urllib.error.URLError):
        return False
    return status == 200 and body == b"ok"


class Held:
    """Replaces ``owner.name`` (a method) with one that, when ``when(*args)`` holds, says so and
    waits until released (at most ``hold_s``) before doing its work."""

    def __init__(self, monkeypatch, owner, name: str, when=lambda *args: True, hold_s=15.0):
        self.entered, self.release = threading.Event(), threading.Event()
        self.count = 0
        original = getattr(owner, name)

        def held(*args, **kwargs):
            if when(*args):
                self.count += 1
                self.entered.set()
                self.release.wait(hold_s)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, held)


def health_while_held(server, held: Held, send) -> tuple[bool, object]:
    """Start ``send()`` on a thread; once the held step is entered, ask /health (3 s), then
    release the step. Returns (whether /health answered meanwhile, what ``send`` returned)."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(reply=send()))
    worker.start()
    assert held.entered.wait(60), "the request never reached the held step"
    try:
        answered = health(server, timeout=3.0)
    finally:
        held.release.set()
    worker.join(timeout=120)
    assert not worker.is_alive()
    return answered, result["reply"]


# ---- heavy work off the event loop (items 3, 4) ----------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_health_answers_while_a_prompt_is_tokenized(server, monkeypatch, path):
    held = Held(monkeypatch, OpenAIServing, "tokenize")
    text = "tokenize me " * 400  # a body over INLINE_BODY_BYTES: tokenized off the event loop
    if path == "/v1/completions":
        body = {"prompt": text, "max_tokens": 2}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    answered, (status, reply) = health_while_held(server, held, lambda: post(server, body, path))
    assert answered, "/health waited for a prompt being tokenized"
    assert_openai_error(status, reply, 400, contains="max_model_len=96")


def test_health_answers_while_a_large_response_is_built(server, monkeypatch):
    held = Held(monkeypatch, TokenStrings, "text")
    body = {"prompt": "x" * 60, "max_tokens": 2, "echo": True, "logprobs": 20, "temperature": 0}
    answered, (status, reply) = health_while_held(server, held, lambda: post(server, body))
    assert answered, "/health waited for a response being built"
    assert status == 200, reply[:300]
    lp = json.loads(reply)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 62 and len(lp["top_logprobs"][1]) >= 1


def test_health_answers_while_a_streamed_echo_is_built(server, monkeypatch):
    held = Held(monkeypatch, TokenStrings, "text")
    body = {"prompt": "y" * 40, "max_tokens": 3, "echo": True, "logprobs": 5, "stream": True}
    answered, (status, reply) = health_while_held(server, held, lambda: post(server, body))
    assert answered, "/health waited for a streamed chunk being built"
    events = sse_events(reply)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["text"].startswith("y" * 40)


def test_health_answers_while_a_grammar_compiles(server, monkeypatch):
    held = Held(monkeypatch, GrammarCompiler, "compile")
    body = {"prompt": "Hi", "max_tokens": 3, "structured_outputs": {"regex": "[ab]{1,6}"}}
    answered, (status, reply) = health_while_held(server, held, lambda: post(server, body))
    assert answered, "/health waited for a grammar being compiled"
    assert status == 200, reply[:300]


def test_health_answers_during_real_megabyte_prompts(server, monkeypatch):
    """Four concurrent ~0.9 MB prompts (each refused in the end: far over the context), with
    /health polled meanwhile: some /health round trip starts and ends while a tokenization is
    running (on the event loop none could)."""
    spans, lock = [], threading.Lock()
    original = OpenAIServing.tokenize

    def timed(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            with lock:
                spans.append((start, time.monotonic()))

    monkeypatch.setattr(OpenAIServing, "tokenize", timed)
    monkeypatch.setattr(server.serving, "chars_per_token", None)  # as a tokenizer with no bound
    big = {"prompt": "caf\u00e9 au lait, " * 48000, "max_tokens": 2}  # 0.96 MB as JSON
    replies = []
    senders = [threading.Thread(target=lambda: replies.append(post(server, big))) for _ in range(4)]
    for s in senders:
        s.start()
    trips = []
    while any(s.is_alive() for s in senders):
        start = time.monotonic()
        assert health(server, timeout=30.0)
        trips.append((start, time.monotonic()))
        time.sleep(0.01)
    for s in senders:
        s.join()
    assert [r[0] for r in replies] == [400] * 4
    assert len(spans) == 4
    inside = [t for t in trips if any(a < t[0] and t[1] < b for a, b in spans)]
    assert inside, f"no /health answered during a tokenization: {spans=} {trips[:20]=}"


def small_request_while_held(server, held: Held, sends: list) -> tuple[int, list]:
    """Start every ``sends`` call on its own thread; once ``len(sends)`` held steps are entered
    (or queued behind them), send a small completion (10 s). Returns its status and the
    replies of ``sends``."""
    replies = []
    workers = [threading.Thread(target=lambda f=f: replies.append(f())) for f in sends]
    for w in workers:
        w.start()
    assert held.entered.wait(60)
    time.sleep(1.0)  # the rest reach their lane's queue
    try:
        status, _ = post(server, {"prompt": "Hi", "max_tokens": 2}, timeout=10)
    except (TimeoutError, urllib.error.URLError):
        status = None
    finally:
        held.release.set()
    for w in workers:
        w.join(timeout=120)
    return status, replies


def test_slow_grammar_compiles_do_not_queue_small_requests(server, monkeypatch):
    held = Held(monkeypatch, GrammarCompiler, "compile")
    body = {"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"regex": "[cd]{1,5}"}}
    sends = [lambda: post(server, body) for _ in range(6)]
    status, replies = small_request_while_held(server, held, sends)
    assert status == 200, "a small request waited behind grammar compilation"
    assert [r[0] for r in replies] == [200] * 6


def test_huge_prompts_do_not_queue_small_requests(server, monkeypatch):
    held = Held(monkeypatch, OpenAIServing, "tokenize", when=lambda self, text, *a: len(text) > 1e4)
    big = {"prompt": "w " * 100_000, "max_tokens": 2}  # 200 KB: the heavy lane
    status, replies = small_request_while_held(server, held, [lambda: post(server, big)] * 6)
    assert status == 200, "a small request waited behind huge prompts"
    assert [r[0] for r in replies] == [400] * 6  # over the context


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_text_too_long_for_any_tokenization_to_fit_is_refused_unencoded(
    server, monkeypatch, path
):
    """The byte tokenizer's tokens are at most 7 characters ("<extra>", one token): a text of
    7 x 96 characters is at least 96 tokens whatever it holds, refused before any encoding (96
    "<extra>" are exactly 96); one character fewer is encoded, and refused by the engine's own
    check."""
    from pagedjax.entrypoints.openai import serving_engine

    assert server.serving.chars_per_token == 7
    encoded = []
    real = serving_engine.encode_text

    def counted(tok, text, *args):
        encoded.append(text)
        return real(tok, text, *args)

    monkeypatch.setattr(serving_engine, "encode_text", counted)

    def send(text):
        if path == "/v1/completions":
            return post(server, {"prompt": text, "max_tokens": 2}, path)
        return post(server, {"messages": [{"role": "user", "content": text}]}, path)

    status, reply = send("<extra>" * MAX_MODEL_LEN)
    assert_openai_error(status, reply, 400, contains="max_model_len=96")
    error = json.loads(reply)["error"]
    assert error["code"] == "context_length_exceeded", error
    assert "at least 9" in error["message"], error  # 96 tokens; the chat template adds to them
    assert not encoded
    if path == "/v1/completions":
        under = "<extra>" * (MAX_MODEL_LEN - 1) + "x" * 6  # 671 characters, 101 tokens
        status, reply = send(under)
        assert_openai_error(status, reply, 400, contains="the prompt has 101 tokens")
        assert encoded == [under]


# ---- responses too large to build are refused up front (item 3) -----------------------------


def test_echo_with_logprobs_over_the_response_limit_is_a_400(server):
    prompts = ["z" * 80] * 4  # 4 x (80 + 4 tokens) x 21 > 5000
    status, reply = post(server, {"prompt": prompts, "max_tokens": 4, "echo": True, "logprobs": 20})
    err = assert_openai_error(status, reply, 400, param="logprobs")
    assert (
        "--max-response-logprobs" in err["message"] and str(MAX_RESPONSE_LOGPROBS) in err["message"]
    )
    status, _ = post(server, {"prompt": prompts[:1], "max_tokens": 4, "echo": True, "logprobs": 20})
    assert status == 200  # 84 x 21 = 1764 entries


def test_chat_logprobs_over_the_response_limit_is_a_400(server):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "logprobs": True,
        "top_logprobs": 20,
        "n": 3,
        "max_tokens": 80,  # 3 x 80 x 21 > 5000
    }
    status, reply = post(server, body, "/v1/chat/completions")
    assert_openai_error(status, reply, 400, param="top_logprobs", contains="5000")
    status, _ = post(server, {**body, "n": 1, "max_tokens": 4}, "/v1/chat/completions")
    assert status == 200


def test_the_cli_passes_the_response_limit_to_the_server(monkeypatch):
    import pagedjax.entrypoints.api_server as api_server
    from pagedjax.cli import main

    got = []
    monkeypatch.setattr(api_server, "serve", lambda engine_args, o: got.append(o.limits))
    assert main(["serve", "--model", "m", "--max-response-logprobs", "1234"]) == 0
    assert main(["serve", "--model", "m"]) == 0
    assert [g.max_response_logprobs for g in got] == [1234, 1 << 20]
    with pytest.raises(ValueError, match="max_response_logprobs"):
        ServerLimits(max_response_logprobs=0)


# ---- logit_bias keys (item 7) ----------------------------------------------------------------

BAD_KEYS = ["\u00b2", "--5", "5" * 5000, "\u0663", "1_0", "0x10", "", " ", "1e3", "+-1", "1.0"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("key", BAD_KEYS, ids=range(len(BAD_KEYS)))
def test_logit_bias_keys_that_are_not_token_ids_are_400s(server, path, key):
    body = {"max_tokens": 2, "logit_bias": {key: 5}}
    if path == "/v1/completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    status, reply = post(server, body, path)
    err = assert_openai_error(status, reply, 400, param="logit_bias")
    assert len(err["message"]) < 300  # a 5,000-digit key is not quoted whole


def test_logit_bias_keys_with_spaces_and_signs_still_work(server):
    status, reply = post(
        server, {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "logit_bias": {" 65 ": 100}}
    )
    assert status == 200 and json.loads(reply)["choices"][0]["text"] == "AA"
    status, reply = post(server, {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"-1": 1}})
    assert_openai_error(status, reply, 400, param="logit_bias", contains="outside the vocabulary")


# ---- stop_reason, streamed and not (item 10) -------------------------------------------------


LETTERS = {str(b): 40 for b in b"abcdefgh"}  # a random model, steered to readable text


def stop_cases(text: str) -> list[tuple[dict, object]]:
    """(extra body fields, expected stop_reason) from an unstopped greedy ASCII ``text``
    (token b is byte b)."""
    stop = text[4:6]
    return [
        ({"stop": ["\x00never", stop]}, stop),
        ({"stop_token_ids": [ord(text[5])]}, ord(text[5])),
        ({}, None),  # max_tokens: "length"
    ]


def final_choice(events: list) -> dict:
    finals = []
    for e in events[:-1]:
        for choice in e["choices"]:
            assert "stop_reason" in choice, choice  # on every streamed choice, as vLLM's
            if choice["finish_reason"] is not None:
                finals.append(choice)
    (final,) = finals
    return final


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_reason_streamed_equals_not_streamed(server, path):
    base = {"max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True, "logit_bias": LETTERS}
    if path == "/v1/completions":
        base["prompt"] = PROMPT
    else:
        base["messages"] = [{"role": "user", "content": PROMPT}]
    status, reply = post(server, base, path)
    assert status == 200
    choice = json.loads(reply)["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert len(text) == GEN_TOKENS and set(text) <= set("abcdefgh"), text
    for fields, expect in stop_cases(text):
        status, reply = post(server, {**base, **fields}, path)
        assert status == 200, reply[:300]
        choice = json.loads(reply)["choices"][0]
        assert choice["finish_reason"] == ("length" if expect is None else "stop"), fields
        assert choice["stop_reason"] == expect, fields
        status, reply = post(server, {**base, **fields, "stream": True}, path)
        assert status == 200
        streamed = final_choice(sse_events(reply))
        assert streamed["finish_reason"] == choice["finish_reason"]
        assert streamed["stop_reason"] == expect, fields
    assert wait_idle(server.base, key=KEY)["pagedjax_kv_blocks_used"] == 0


# ---- non-finite numbers name their field (found by test_server_field_fuzz) -------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (b'"logit_bias": Infinity', "logit_bias"),
        (b'"logit_bias": {"5": NaN}', "logit_bias.5"),
        (b'"temperature": -Infinity', "temperature"),
        (b'"stop": [NaN]', "stop.0"),
    ],
)
def test_nan_and_infinity_are_400s_naming_their_field(server, fields, param):
    body = b'{"model": "%s", "prompt": "Hi", %s}' % (MODEL.encode(), fields)
    status, reply = raw(server.base, "POST", "/v1/completions", body, key=KEY)
    assert_openai_error(status, reply, 400, param=param, contains="finite")


def test_the_prompts_of_one_request_are_taken_between_the_same_two_steps(server, monkeypatch):
    """A completion with several prompts reaches the engine as one command: every prompt is
    added before the next step, so that they are prefilled together (as LLM.generate's are), not
    one per step."""
    engine, events = server.engine, []
    real_add, real_step = engine.add_request, engine.step

    def add_request(request_id, *args, **kwargs):
        events.append(request_id)
        return real_add(request_id, *args, **kwargs)

    def step():
        events.append("step")
        return real_step()

    monkeypatch.setattr(engine, "add_request", add_request)
    monkeypatch.setattr(engine, "step", step)
    status, reply = post(server, {"prompt": [f"p{i} x" for i in range(6)], "max_tokens": 3})
    assert status == 200, reply[:300]
    assert [c["index"] for c in json.loads(reply)["choices"]] == list(range(6))
    adds = [i for i, e in enumerate(events) if e != "step"]
    assert len(adds) == 6 and adds == list(range(adds[0], adds[0] + 6)), events
