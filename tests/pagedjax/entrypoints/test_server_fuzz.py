"""A property-based fuzzer over the request schemas against a live server (issue 24).

Hypothesis draws completion and chat bodies (wrong types, extremes, non-finite numbers, Unicode
with lone surrogates, nesting, sizes, unsupported fields, malformed JSON) and sends them to a
uvicorn server over a tiny model while well-behaved greedy streams run next to them. Properties:
no 5xx but a full queue's 503, every error in OpenAI's error JSON, every accepted stream ends
with ``[DONE]`` and no error event, the well-behaved streams all get the offline engine's text,
and the KV pool is empty afterwards.
"""

from __future__ import annotations

import asyncio
import json
import threading
import types

import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_helpers import (
    byte_llm,
    live_server,
    raw,
    sse_events,
    stream_text,
    wait_idle,
)

from pagedjax import SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import ServerLimits, build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

KEY = "fuzz-key"
MODEL = "tiny-fuzz"
MAX_MODEL_LEN = 64
GOOD_PROMPTS = ["Hello there", "caf\u00e9 au lait"]
GOOD_TOKENS = 16
EXAMPLES = 120  # make test; the slow run draws many more


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = byte_llm(
        tmp_path_factory, "fuzz_llama", num_blocks=160, max_model_len=MAX_MODEL_LEN, max_num_seqs=8
    )
    greedy = SamplingParams(max_tokens=GOOD_TOKENS, temperature=0, ignore_eos=True)
    refs = [o.outputs[0].text for o in llm.generate(GOOD_PROMPTS, greedy, use_tqdm=False)]
    limits = ServerLimits(max_queue=8, max_body_bytes=64 * 1024, body_timeout_s=10)
    app = build_app(
        EngineLoop(llm.engine, limits.max_queue), MODEL, AppOptions(api_key=KEY, limits=limits)
    )
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base, refs=refs)


class GoodStreams:
    """Greedy streams, two at a time, over and over until stopped; each must match its
    offline reference."""

    def __init__(self, server):
        self.server = server
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _one(self, client, i: int) -> None:
        while not self.stop.is_set():
            try:
                text = await stream_text(client, MODEL, GOOD_PROMPTS[i], GOOD_TOKENS)
            except Exception as e:  # a stream cut or refused
                self.failures.append(f"stream {i}: {type(e).__name__}: {e}")
                continue
            if text != self.server.refs[i]:
                self.failures.append(f"stream {i}: got {text!r}, want {self.server.refs[i]!r}")
            self.done += 1

    async def _main(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=self.server.base + "/v1", api_key=KEY, max_retries=0, timeout=120
        )
        try:
            await asyncio.gather(*(self._one(client, i) for i in range(len(GOOD_PROMPTS))))
        finally:
            await client.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=120)


# ---- strategies -----------------------------------------------------------------------------
# A body is drawn valid, field by field; then, most of the time, one field (or an unknown one)
# is replaced by anything at all, so that each refusal is exercised next to a request that would
# otherwise run.

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=24)  # lone surrogates too
INTS = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63)]),
    st.integers(),
)
FLOATS = st.one_of(
    st.floats(-3, 3),
    st.floats(),  # inf and NaN too, sent as Infinity / NaN
    st.sampled_from([0.0, -0.0, 1e-30, 5e-324, 1e308]),
)
JSON = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=10,
)
BAD = st.one_of(INTS, FLOATS, ANY_TEXT, JSON, st.lists(ANY_TEXT, max_size=80))
# Just inside and just outside what the engine represents (int32 sampler fields, 64-bit seeds).
EDGE_INTS = st.sampled_from(
    [-2, -1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 10**30]
)
EDGE_FLOATS = st.sampled_from(
    [-0.0, 5e-324, 1e-30, 0.009, 100.5, 1e308, -1e308, float("inf"), float("nan"), 2**64]
)
NUMERIC = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "best_of",
}

GOOD_COMMON = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.one_of(st.integers(-1, 300), st.just(2**31 - 1)),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 2),
    "stop": st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), max_size=3)),
    "seed": st.integers(0, 2**64 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 100),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 259), max_size=3),
    "user": TEXT,
    "best_of": st.sampled_from([None, 2]),
    "logit_bias": st.dictionaries(st.integers(0, 259).map(str), st.floats(-100, 100), max_size=3),
    "structured_outputs": st.sampled_from(
        [None, {"regex": "[a-z]{1,4}"}, {"choice": ["yes", "no"]}, {"json_object": True}]
    ),
    "max_tokens": st.integers(1, 8),
}
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
GOOD_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": st.one_of(TEXT, st.lists(TEXT_PART, min_size=1, max_size=3)),
    }
)
BAD_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": BAD}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image_url", "input_audio", "file", "refusal"]), "x": JSON}
    ),
    JSON,
)
BAD_MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(ANY_TEXT, JSON), "content": st.one_of(BAD, st.lists(BAD_PART))}
        ),
        max_size=3,
    ),
    BAD,
)
GOOD_CHAT = {
    **GOOD_COMMON,
    "max_completion_tokens": st.integers(1, 8),
    "logprobs": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
GOOD_COMPLETION = {**GOOD_COMMON, "logprobs": st.integers(0, 5), "echo": st.booleans()}
GOOD_PROMPT = st.one_of(
    TEXT.filter(bool),
    st.lists(TEXT.filter(bool), min_size=1, max_size=3),
    st.lists(st.integers(0, 259), min_size=1, max_size=20),
    st.lists(st.lists(st.integers(0, 259), min_size=1, max_size=8), min_size=1, max_size=3),
)
BAD_PROMPT = st.one_of(
    BAD,
    st.lists(st.integers(-2, 300), max_size=20),
    st.lists(TEXT, max_size=12),
    st.text(max_size=3000),
)
EXTRA_FIELDS = ["top_logprobs", "tools", "tool_choice", "suffix", "stream_options", "x"]


@st.composite
def request_body(draw, chat: bool) -> dict:
    good = GOOD_CHAT if chat else GOOD_COMPLETION
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 8))}  # keeps the run short
    if chat:
        body["messages"] = draw(st.lists(GOOD_MESSAGE, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(GOOD_PROMPT)
    for name in draw(st.lists(st.sampled_from(sorted(good)), max_size=6, unique=True)):
        body[name] = draw(good[name])
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if chat and body.get("logprobs") and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(0, 5))
    if draw(st.integers(0, 3)):  # one field made bad (or an unknown one added)
        numeric = sorted(NUMERIC & set(good))
        names = ["model", "prompt_or_messages", *sorted(good), *EXTRA_FIELDS, *numeric]
        name = draw(st.sampled_from(names))
        if name == "prompt_or_messages":
            name, value = ("messages", draw(BAD_MESSAGES)) if chat else ("prompt", draw(BAD_PROMPT))
        elif name in NUMERIC:
            value = draw(st.one_of(EDGE_INTS, EDGE_INTS, EDGE_FLOATS, BAD))
        else:
            value = draw(BAD)
        body[name] = value
    return body


# Bodies no JSON encoder writes: malformed, deep, huge numbers, bad bytes.
RAW = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 200_000).map(lambda k: b"[" * k),
    st.integers(1, 6000).map(
        lambda k: b'{"model": "tiny-fuzz", "prompt": "x", "n": 1%s}' % (b"0" * k)
    ),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"model": "tiny-fuzz", "prompt": NaN}']),
)
REQUEST = st.one_of(
    st.tuples(st.just("/v1/completions"), request_body(chat=False)),
    st.tuples(st.just("/v1/chat/completions"), request_body(chat=True)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), RAW),
)


# Always tried first: past int32 and 64 bits on the fields the sampler packs into arrays.
EDGE_EXAMPLES = [
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value})
    for field in ("top_k", "n", "max_tokens", "seed", "logprobs", "best_of")
    for value in (2**31, 2**63, 2**64 - 1)
] + [
    ("/v1/chat/completions", {**body, "model": MODEL, "max_tokens": 2})
    for body in (
        {"messages": [{"role": "user", "content": "Hi"}], "top_k": 2**31, "stream": True},
        {"messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [2**31]},
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2**31},
    )
]
# The slow run's find: best_of stood in for a negative n, a 200 with no choices.
EDGE_EXAMPLES += [
    ("/v1/completions", {"model": MODEL, "prompt": "0", "max_tokens": 1, "best_of": 2, "n": n})
    for n in (-2, 0)
]


# ---- the properties -------------------------------------------------------------------------


def check_reply(path: str, sent, status: int, reply: bytes) -> None:
    where = f"{path} {sent!r:.600} -> {status} {reply[:600]!r}"
    if status != 200:
        assert status < 500 or status == 503, where
        err = json.loads(reply)["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and isinstance(err["type"], str), where
        if status == 503:
            assert err["code"] == "queue_full", where
        return
    if isinstance(sent, dict) and sent.get("stream") is True:
        events = sse_events(reply)
        assert events and events[-1] == "[DONE]", where
        assert not any(isinstance(e, dict) and "error" in e for e in events), where
    else:
        out = json.loads(reply)
        assert "error" not in out and out["choices"], where


def fuzz_settings(examples: int, derandomize: bool) -> settings:
    """Hypothesis settings for a server fuzzer: no deadline, no database, no health checks."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def fuzz(server, examples: int, derandomize: bool) -> None:
    statuses: dict[int, int] = {}

    @fuzz_settings(examples, derandomize)
    @given(request=REQUEST)
    def one(request):
        path, sent = request
        data = sent if isinstance(sent, bytes) else json.dumps(sent).encode()
        status, reply = raw(server.base, "POST", path, data, key=KEY, timeout=30)
        statuses[status] = statuses.get(status, 0) + 1
        check_reply(path, sent, status, reply)

    for request in EDGE_EXAMPLES:
        one = example(request=request)(one)
    with GoodStreams(server) as good:
        one()
    print(f"fuzzer: {sum(statuses.values())} requests, by status {sorted(statuses.items())}")
    assert statuses.get(200, 0) >= examples // 10, statuses  # enough get through to generate
    assert not good.failures, good.failures[:5]
    assert good.done >= len(GOOD_PROMPTS)
    assert wait_idle(server.base, key=KEY)["pagedjax_kv_blocks_used"] == 0


def test_fuzz_requests_next_to_good_streams(server):
    fuzz(server, EXAMPLES, derandomize=True)


@pytest.mark.slow
def test_fuzz_requests_next_to_good_streams_long(server):
    fuzz(server, 3000, derandomize=False)
