"""Server hardening (issue 24): one request can fail, stall or be refused, never hurt another.

Runs a tiny random Llama with a byte-level BPE tokenizer (every byte one token, as GPT-2-style
vocabularies spell them), so that logprob bytes of split characters can be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import types

import openai
import pytest
import uvicorn
from hf_models import make_tiny_model
from server_helpers import (
    BODY_TIMEOUT_S,
    CHAT_TEMPLATE,
    KEY,
    MAX_MODEL_LEN,
    MAX_QUEUE,
    MODEL,
    PROMPTS,
    SPECIALS,
    assert_openai_error,
    live_server,
    make_byte_model,
    metrics,
    raw,
    save_byte_tokenizer,
    sse_events,
    stream_text,
    wait_idle,
)

from pagedjax import LLM, SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.engine.request import Request
from pagedjax.entrypoints.api_server import ServerLimits, build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

NO_EOS_TOKENS = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("byte_llama")
    make_byte_model(path)
    llm = LLM(str(path), block_size=8, num_blocks=200, max_model_len=MAX_MODEL_LEN, seed=0)
    greedy = SamplingParams(max_tokens=NO_EOS_TOKENS, temperature=0, ignore_eos=True)
    refs = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    lp_params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    chat_lp_ref = llm.chat(messages, lp_params, use_tqdm=False)[0]
    limits = ServerLimits(max_queue=MAX_QUEUE, body_timeout_s=BODY_TIMEOUT_S)
    app = build_app(
        EngineLoop(llm.engine, limits.max_queue), MODEL, AppOptions(api_key=KEY, limits=limits)
    )
    with live_server(app) as base:
        yield types.SimpleNamespace(
            base=base, engine=llm.engine, refs=refs, chat_lp_ref=chat_lp_ref, path=path
        )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


@contextlib.contextmanager
def streams_running(server, n=3):
    """Well-behaved greedy streams running meanwhile; on exit, asserts each finished with the
    offline engine's text."""
    results: dict = {}

    async def one(client, i):
        return await stream_text(client, MODEL, PROMPTS[i % len(PROMPTS)], NO_EOS_TOKENS)

    async def main():
        client = openai.AsyncOpenAI(
            base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120
        )
        try:
            return await asyncio.gather(*(one(client, i) for i in range(n)))
        finally:
            await client.close()

    worker = threading.Thread(target=lambda: results.update(texts=asyncio.run(main())))
    worker.start()
    deadline = time.monotonic() + 60
    while metrics(server.base)["pagedjax_num_requests_running"] == 0:
        assert worker.is_alive() and time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.01)
    yield
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert results["texts"] == [server.refs[i % len(PROMPTS)] for i in range(n)]


def completion(prompt="Hello", **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}


def chat(content="Hello", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


# ---- 1. an out-of-range value is refused; a failure inside the engine stays with its request --


def test_top_k_past_int32_is_a_400_while_others_stream(server, client):
    with streams_running(server):
        with pytest.raises(openai.BadRequestError, match="top_k") as e:
            client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=4, extra_body={"top_k": 2**31}
            )
        assert e.value.body["param"] == "top_k"
        r = client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"top_k": 2**31 - 1}
        )
        assert r.choices[0].finish_reason in ("length", "stop")
    wait_idle(server.base)


@contextlib.contextmanager
def failing_requests(engine, seed: int):
    """Requests with this seed fail inside ``engine.step`` (while their sampling rows are built),
    the way a bad value that slipped through validation would."""
    original = Request.sampling_rows

    def sampling_rows(req, chunk, vocab_size):
        if getattr(req.params, "seed", None) == seed:
            raise RuntimeError("planted failure")
        return original(req, chunk, vocab_size)

    Request.sampling_rows = sampling_rows
    try:
        yield
    finally:
        Request.sampling_rows = original


def test_a_request_failing_in_the_engine_ends_alone(server):
    with failing_requests(server.engine, seed=4242), streams_running(server):
        status, body = raw(server.base, "POST", "/v1/completions", completion(seed=4242))
        err = assert_openai_error(status, body, 500, contains="planted failure")
        assert err["type"] == "server_error"
        status, body = raw(
            server.base, "POST", "/v1/chat/completions", chat(seed=4242, stream=True)
        )
        assert status == 200
        events = sse_events(body)
        assert events[-1] == "[DONE]" and "planted failure" in events[-2]["error"]["message"]
        # n prompts in one request: the whole request fails, the others of its batch are freed.
        status, body = raw(
            server.base, "POST", "/v1/completions", completion(["a", "b", "c"], seed=4242)
        )
        assert_openai_error(status, body, 500)
    assert wait_idle(server.base)["pagedjax_request_errors_total"] >= 3


def test_a_step_that_raises_ends_every_stream_with_an_error_then_done(server):
    engine, original = server.engine, server.engine.step
    failed = []

    def step():  # fails once, with all three requests in the engine: until they are, no
        # step runs (adds come in between steps), so none can finish before the failure
        if failed:
            return original()
        if len(engine.requests) < 3:
            time.sleep(0.005)
            return []
        failed.append(1)
        raise RuntimeError("the step blew up")

    streams = []

    def stream(i):
        body = completion(PROMPTS[i], max_tokens=20, stream=True, ignore_eos=True)
        streams.append(raw(server.base, "POST", "/v1/completions", body))

    engine.step = step
    try:
        workers = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
    finally:
        del engine.step
    assert len(streams) == 3
    for status, body in streams:
        events = sse_events(body)
        assert status == 200 and events[-1] == "[DONE]"
        assert any(isinstance(e, dict) and "error" in e for e in events), events
        assert "the step blew up" in events[-2]["error"]["message"]
    assert wait_idle(server.base)["pagedjax_step_failures_total"] >= 1
    # And the server goes on serving.
    status, body = raw(server.base, "POST", "/v1/completions", completion())
    assert status == 200


# ---- 2. stop strings are capped ---------------------------------------------------------------


def test_stop_strings_are_capped(server, client):
    status, body = raw(server.base, "POST", "/v1/completions", completion(stop=["zz"] * 90_000))
    assert_openai_error(status, body, 400, param="stop", contains="at most 64")
    with pytest.raises(openai.BadRequestError, match="1024 characters"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stop=["x" * 1025])
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"stop_token_ids": [5] * 65}
        )
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stop=["x" * 1024] * 64)
    assert r.choices[0].finish_reason == "length"


# ---- 3. bodies that used to get 500s ---------------------------------------------------------


def test_bad_unicode_parts_nesting_and_huge_numbers_are_400s(server):
    def post(path, body: bytes):
        return raw(server.base, "POST", path, body)

    lone = b'"\\ud800 x"'
    assert_openai_error(
        *post("/v1/completions", b'{"model": "tiny-bytes", "prompt": ' + lone + b"}"),
        400,
        param="prompt",
        contains="surrogate",
    )
    chat_lone = b'{"model": "tiny-bytes", "messages": [{"role": "user", "content": ' + lone + b"}]}"
    assert_openai_error(*post("/v1/chat/completions", chat_lone), 400, contains="surrogate")
    for text in (None, 5, ["a"], {"a": 1}):
        body = chat([{"type": "text", "text": text}])
        status, reply = raw(server.base, "POST", "/v1/chat/completions", body)
        assert_openai_error(status, reply, 400, param="messages.0.content.0.text")
    assert_openai_error(*post("/v1/completions", b"[" * 100_000), 400, contains="nest")
    deep = {"model": MODEL, "prompt": "x", "stream_options": {}}
    node = deep["stream_options"]
    for _ in range(40):
        node["a"] = node = {}
    assert_openai_error(*post("/v1/completions", json.dumps(deep).encode()), 400)
    huge = b'{"model": "tiny-bytes", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    assert_openai_error(*post("/v1/completions", huge), 400, contains="not valid JSON")
    big = b'{"model": "tiny-bytes", "prompt": "x", "max_tokens": ' + b"9" * 400 + b"}"
    assert_openai_error(*post("/v1/completions", big), 400, param="max_tokens")
    big_float = b'{"model": "tiny-bytes", "prompt": "x", "temperature": ' + b"9" * 400 + b"}"
    assert_openai_error(*post("/v1/completions", big_float), 400, param="temperature")
    assert_openai_error(*post("/v1/completions", b"\xff\xfe{"), 400)
    assert_openai_error(*post("/v1/completions", b'"a string"'), 400, contains="JSON object")


# ---- 4. max_completion_tokens: 0 ---------------------------------------------------------------


def test_max_completion_tokens_zero_is_a_400(server, client):
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens") as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=0
        )
    assert e.value.body["param"] == "max_completion_tokens"
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        max_tokens=50,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3  # max_completion_tokens wins over max_tokens


# ---- 5. an empty API key is a start-up error ---------------------------------------------------


def test_empty_api_key_refuses_to_start(server, capsys):
    from pagedjax.cli import main

    with pytest.raises(ValueError, match="api-key"):
        build_app(EngineLoop(server.engine), MODEL, AppOptions(api_key=""))
    start = time.monotonic()
    assert main(["serve", "--model", str(server.path), "--api-key", ""]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    assert time.monotonic() - start < 5  # refused before loading anything


# ---- 6. more prompts than the queue holds ------------------------------------------------------


def test_more_prompts_than_the_queue_is_a_400_not_a_503(server):
    body = completion(["Hi"] * (MAX_QUEUE + 1))
    assert_openai_error(*raw(server.base, "POST", "/v1/completions", body), 400, param="prompt")
    body = completion([[72, 105]] * (MAX_QUEUE + 1))
    assert_openai_error(*raw(server.base, "POST", "/v1/completions", body), 400, param="prompt")
    status, reply = raw(server.base, "POST", "/v1/completions", completion(["Hi"] * MAX_QUEUE))
    assert status == 200 and len(json.loads(reply)["choices"]) == MAX_QUEUE


# ---- 7. logprob bytes and text offsets -----------------------------------------------------


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(server):
    ids = server.chat_lp_ref.outputs[0].token_ids
    assert any(0x80 <= t < 256 for t in ids), "want some non-ASCII byte tokens"
    specials = {256: b"<s>", 257: b"</s>", 258: b"<pad>", 259: b"<extra>"}
    expected = [list(specials.get(t, bytes([t % 256]))) for t in ids]
    body = chat(PROMPTS[2], max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    status, reply = raw(server.base, "POST", "/v1/chat/completions", {**body, "top_logprobs": 3})
    assert status == 200
    content = json.loads(reply)["choices"][0]["logprobs"]["content"]
    assert [c["bytes"] for c in content] == expected
    for c in content:
        assert all(len(t["bytes"]) == 1 or t["token"] in SPECIALS for t in c["top_logprobs"])
    # Pieces of a character split over tokens (an emoji is four) join back into its bytes.
    byte_ids = [t for t in ids if t < 256]
    joined = b"".join(bytes(c["bytes"]) for c, t in zip(content, ids, strict=True) if t < 256)
    assert joined == bytes(byte_ids)


def test_completion_text_offsets_are_positions_in_the_text(server, client):
    for prompt in PROMPTS:
        kwargs = dict(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        r = client.completions.create(**kwargs)
        text, lp = r.choices[0].text, r.choices[0].logprobs
        offsets = lp.text_offset
        assert len(offsets) == len(lp.tokens) == 12
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
        # An ASCII byte after another starts where its character is in the text (a byte after
        # an unfinished character may join a replacement character instead; special tokens
        # leave no text).
        for i, (tok, off) in enumerate(zip(lp.tokens, offsets, strict=True)):
            if tok in SPECIALS:
                continue
            if tok.isascii() and (i == 0 or lp.tokens[i - 1].isascii()):
                assert text[off : off + len(tok)] == tok
        streamed = []
        for chunk in client.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs:
                streamed += chunk.choices[0].logprobs.text_offset
        assert streamed == offsets


# ---- 8. strict numbers, unsupported fields, 64-bit seeds, the missing routes -------------------


def test_non_finite_and_out_of_range_numbers_are_400s(server):
    for field in ("temperature", "top_p", "presence_penalty", "repetition_penalty"):
        for value in (b"Infinity", b"-Infinity", b"NaN", b"1e999"):
            body = b'{"model": "tiny-bytes", "prompt": "x", "%s": %s}' % (field.encode(), value)
            status, reply = raw(server.base, "POST", "/v1/completions", body)
            assert_openai_error(status, reply, 400)
    for value in (1e-30, 0.0, 1e6):
        body = completion(repetition_penalty=value)
        assert_openai_error(
            *raw(server.base, "POST", "/v1/completions", body), 400, param="repetition_penalty"
        )


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),  # best_of below n
        ("/v1/completions", {"best_of": 2, "n": -2}, "n"),  # was 200 with no choices
        ("/v1/completions", {"best_of": 2, "n": 0}, "n"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),  # out of [-100, 100]
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"min_length": 3}, "min_length"),  # unknown fields are not ignored
        ("/v1/completions", {"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
        ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {}}]},
            "tools.0.function.name",
        ),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_fields_are_refused_by_name(server, path, fields, param):
    body = (completion if "chat" not in path else chat)(**fields)
    assert_openai_error(*raw(server.base, "POST", path, body), 400, param=param)


def test_neutral_values_of_unsupported_fields_and_image_parts(server, client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=2, n=2)
    assert len(r.choices) == 2
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=2,
        response_format={"type": "text"},
        logit_bias={},
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="image_url") as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [image]}], max_tokens=2
        )
    assert e.value.body["param"] == "messages.0.content.0.type"


def test_64_bit_seeds_are_taken_and_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0)
    a = client.completions.create(seed=2**63 + 12345, **kwargs).choices[0].text
    assert a == client.completions.create(seed=2**63 + 12345, **kwargs).choices[0].text
    client.completions.create(seed=2**64 - 1, **kwargs)
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(seed=2**64, **kwargs)


def test_models_retrieve_and_head_health(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
    status, body = raw(server.base, "HEAD", "/health", key=None)
    assert status == 200 and body == b""


# ---- auth covers /metrics and the docs; slow bodies are dropped -------------------------------


def test_metrics_and_docs_are_behind_the_key(server):
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        status, body = raw(server.base, "GET", path, key=None)
        assert_openai_error(status, body, 401)
        assert raw(server.base, "GET", path)[0] == 200
    assert raw(server.base, "GET", "/health", key=None)[0] == 200


def test_a_body_that_stalls_is_dropped(server):
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\n"
            f"Host: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model": "tiny-b')
        start = time.monotonic()
        reply = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            reply += chunk
        waited = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert BODY_TIMEOUT_S * 0.9 <= waited < BODY_TIMEOUT_S + 10
    assert b"request_timeout" in reply


# ---- 9. pagedjax serve takes the model's own context limit ------------------------------------


def test_cli_serve_defaults_to_the_models_context_and_opens_what_flags_say(tmp_path, monkeypatch):
    from pagedjax.cli import main

    path = tmp_path / "short_context"
    make_tiny_model("llama_gqa", path, max_position_embeddings=300)  # under the old 2048
    save_byte_tokenizer(path, CHAT_TEMPLATE)
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    args = ["serve", "--model", str(path), "--num-blocks", "64", "--api-key", KEY, "--no-warmup"]
    assert main([*args, "--served-model-name", "short", "--public-metrics"]) == 0
    (app,) = apps
    with live_server(app) as base:
        cards = json.loads(raw(base, "GET", "/v1/models")[1])["data"]
        assert cards[0]["max_model_len"] == 300
        assert raw(base, "GET", "/metrics", key=None)[0] == 200  # --public-metrics
        assert raw(base, "GET", "/openapi.json", key=None)[0] == 401


def test_requests_that_could_never_run_are_400_while_streams_run(server):
    """The engine's admission check over HTTP: the limit is in the message, nothing is queued."""
    with streams_running(server):
        status, body = raw(server.base, "POST", "/v1/completions", completion(n=300))
        assert "max_num_seqs=256" in assert_openai_error(status, body, 400)["message"]
        # Every sequence of n=64 up to max_model_len: more blocks than the pool has.
        big = completion(n=64, max_tokens=MAX_MODEL_LEN, temperature=1.0)
        status, body = raw(server.base, "POST", "/v1/completions", big)
        assert "KV blocks at once" in assert_openai_error(status, body, 400)["message"]
    wait_idle(server.base)
