"""A fuzzer over the fields a client fills with structure (issue 41): ``logit_bias``,
``structured_outputs``, ``response_format``, ``stop`` and ``tools``, and vLLM's
``allowed_token_ids``, ``min_tokens``, ``chat_template_kwargs`` and ``continue_final_message``.

Hypothesis draws a request that would run, then fills one of those fields with something drawn
for that field: near misses (keys like "²" or "--5", two constraint kinds, a schema as a string
that nests deeply, empty or overlong stop strings) and arbitrary JSON. Property: the server
answers 200, or a 4xx in OpenAI's error JSON whose ``param`` names the field; never a 5xx. A short
derandomized run is part of ``make test``; ``-m slow`` draws many more.
"""

from __future__ import annotations

import json
import types

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from server_helpers import byte_llm, live_server, raw, wait_idle
from test_server_fuzz import fuzz_settings

from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import ServerLimits, build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

KEY = "field-fuzz-key"
MODEL = "tiny-field-fuzz"
EXAMPLES = 60  # make test: a few seconds of requests; the slow run draws many more


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = byte_llm(
        tmp_path_factory, "field_fuzz_llama", num_blocks=160, max_model_len=64, max_num_seqs=8
    )
    limits = ServerLimits(max_queue=8, max_body_bytes=256 * 1024, body_timeout_s=10)
    app = build_app(
        EngineLoop(llm.engine, limits.max_queue), MODEL, AppOptions(api_key=KEY, limits=limits)
    )
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base)


# ---- strategies -----------------------------------------------------------------------------

ANY_TEXT = st.text(max_size=16)  # lone surrogates too: json.dumps writes them as \ud800 escapes
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN and Infinity too
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**400, 1e308, -0.0, 5e-324]),
    ANY_TEXT,
)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


DIGITISH = st.sampled_from(
    [
        "\u00b2",
        "--5",
        "5" * 5000,
        "\u0663",
        "1_0",
        "0x10",
        "",
        " ",
        "1e3",
        "+-1",
        "1.0",
        "-0",
        "260",
        "-1",
        "99999999999999999999999",
        "\uff15",
        "5\x00",
        " 7 ",
        "\u20075",
    ]
)
LOGIT_BIAS = st.one_of(
    st.dictionaries(st.one_of(DIGITISH, ANY_TEXT, st.integers(-5, 300).map(str)), JSON, max_size=4),
    st.dictionaries(st.integers(0, 259).map(str), st.one_of(SCALAR, st.floats(-200, 200))),
    st.dictionaries(st.integers(0, 10**6).map(str), st.just(1.0), min_size=301, max_size=320),
    JSON,
)
SCHEMA = st.one_of(
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["object", "integer", "nope"]), JSON)}
    ),
    st.dictionaries(
        st.sampled_from(["type", "properties", "enum", "$ref", "minimum", "items"]), JSON
    ),
    JSON,
)
KINDS = ["json", "regex", "choice", "grammar", "json_object"]
KIND_VALUE = {
    "json": st.one_of(SCHEMA, SCHEMA.map(json.dumps), st.integers(1, 20000).map(deep), JSON),
    "regex": st.one_of(st.sampled_from(["(", "[z-a]", "a{3,1}", "\\", "", "(?<x>a)"]), JSON),
    "choice": st.one_of(st.lists(st.one_of(ANY_TEXT, JSON), max_size=5), JSON),
    "grammar": st.one_of(st.sampled_from(["start:", "start: x", "root ::= ", "::="]), JSON),
    "json_object": JSON,
}
STRUCTURED = st.one_of(
    st.sampled_from(KINDS).flatmap(lambda k: KIND_VALUE[k].map(lambda v: {k: v})),
    st.lists(st.sampled_from(KINDS), min_size=2, max_size=3, unique=True).map(
        lambda ks: {
            k: {"json_object": True, "regex": "a+", "choice": ["a"]}.get(k, "a") for k in ks
        }
    ),
    st.dictionaries(st.one_of(st.sampled_from([*KINDS, "compiled", "backend"]), ANY_TEXT), JSON),
    JSON,
)
RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.one_of(
                JSON, st.fixed_dictionaries({"name": ANY_TEXT, "schema": KIND_VALUE["json"]})
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["text", "json_object", "xml"]), JSON)}
    ),
    st.dictionaries(ANY_TEXT, JSON),
    JSON,
)
STOP = st.one_of(
    st.lists(st.one_of(ANY_TEXT, JSON), max_size=6),
    st.lists(st.text(min_size=1, max_size=3), min_size=65, max_size=70),
    st.integers(1020, 1030).map(lambda k: ["s" * k]),
    st.sampled_from(["", [""], ["\ud800"], [None], [["a"]]]),
    JSON,
)
FUNCTION = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.one_of(
            JSON, st.fixed_dictionaries({"name": ANY_TEXT, "parameters": st.one_of(SCHEMA, JSON)})
        ),
    }
)
TOOLS = st.one_of(st.lists(st.one_of(FUNCTION, JSON), max_size=3), JSON)
TOKEN_IDS = st.one_of(
    st.lists(st.integers(-3, 300), max_size=8),  # the byte model's vocabulary is 260
    st.lists(st.integers(), max_size=4),
    JSON,
)
TEMPLATE_KWARGS = st.one_of(
    st.dictionaries(
        st.one_of(ANY_TEXT, st.sampled_from(["tokenize", "messages", "tools", "bos_token"])),
        JSON,
        max_size=4,
    ),
    JSON,
)
CHAT_ONLY = {"tools", "chat_template_kwargs", "continue_final_message"}
FIELDS = {
    "allowed_token_ids": TOKEN_IDS,
    "min_tokens": st.one_of(st.integers(-2, 4), st.integers(), JSON),
    "chat_template_kwargs": TEMPLATE_KWARGS,
    "continue_final_message": st.one_of(st.booleans(), JSON),
    "logit_bias": LOGIT_BIAS,
    "structured_outputs": STRUCTURED,
    "response_format": RESPONSE_FORMAT,
    "stop": STOP,
    "tools": TOOLS,
}


@st.composite
def request(draw):
    field = draw(st.sampled_from(sorted(FIELDS)))
    chat = field in CHAT_ONLY or draw(st.booleans())
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 2)), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    body[field] = draw(FIELDS[field])
    return ("/v1/chat/completions" if chat else "/v1/completions"), field, body


# Always tried first: the findings of issue 41 and their neighbours.
EXAMPLES_FIRST = [
    ("/v1/completions", "logit_bias", {"logit_bias": {key: 1}})
    for key in ["\u00b2", "--5", "5" * 5000, "\u0663"]
] + [
    ("/v1/completions", "structured_outputs", {"structured_outputs": {"json": deep(5000)}}),
    ("/v1/completions", "structured_outputs", {"structured_outputs": {"json": True}}),
    # a schema of null or false: StopIteration in the grammar lane, a request never answered;
    # the long prompt takes the same body through the body-check process
    *[
        ("/v1/completions", "structured_outputs", {"structured_outputs": {"json": text}, **long})
        for text in ("null", "false")
        for long in ({}, {"prompt": "x" * 5000})
    ],
    ("/v1/chat/completions", "response_format", {"response_format": {"type": "json_schema"}}),
    ("/v1/completions", "stop", {"stop": [""]}),
    ("/v1/chat/completions", "tools", {"tools": [{"type": "function"}]}),
]


def check_reply(field: str, sent: dict, status: int, reply: bytes) -> None:
    where = f"{field}: {json.dumps(sent)[:400]} -> {status} {reply[:400]!r}"
    assert status < 500 or status == 503, where
    if status == 200:
        out = json.loads(reply)
        assert "error" not in out and out["choices"], where
        return
    err = json.loads(reply)["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    if status == 503:
        assert err["code"] == "queue_full", where
        return
    param = err["param"] or ""
    assert param == field or param.startswith(field + "."), where


def fuzz(server, examples: int, derandomize: bool) -> dict[int, int]:
    statuses: dict[int, int] = {}

    @fuzz_settings(examples, derandomize)
    @given(req=request())
    def one(req):
        path, field, fields = req
        base = {"model": MODEL, "max_tokens": 1}
        base.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {})
        base.update({"prompt": "Hi"} if "chat" not in path else {})
        body = {**base, **fields}
        status, reply = raw(server.base, "POST", path, json.dumps(body).encode(), key=KEY)
        statuses[status] = statuses.get(status, 0) + 1
        check_reply(field, body, status, reply)

    for path, field, fields in EXAMPLES_FIRST:
        one = example(req=(path, field, fields))(one)
    one()
    assert wait_idle(server.base, key=KEY)["pagedjax_kv_blocks_used"] == 0
    return statuses


def test_malformed_structured_fields_are_4xx_naming_them(server):
    statuses = fuzz(server, EXAMPLES, derandomize=True)
    assert statuses.get(400, 0) >= EXAMPLES // 2, statuses


@pytest.mark.slow
def test_malformed_structured_fields_are_4xx_naming_them_long(server):
    fuzz(server, 2000, derandomize=False)
