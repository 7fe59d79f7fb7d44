"""Tool-call parsers on the text each model family writes (hermes: Qwen 2.5 / 3; llama3_json:
Llama 3.1 / 3.2; pythonic: Llama 3.2 / 4), malformed and cut-short replies included, and the
streamed deltas against the whole-output extraction."""

from __future__ import annotations

import json
import random

import pytest

from pagedjax.entrypoints.openai.tool_parsers import PARSERS, DeltaStream, extract, get_parser
from pagedjax.entrypoints.openai.tool_parsers.json_calls import ArrayCallsParser, NamedCallParser

WEATHER = '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}'
QWEN_ONE = f"<tool_call>\n{WEATHER}\n</tool_call>"
QWEN_TWO = (
    f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
    '{"name": "get_current_wind_speed", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>"
)
QWEN3_THINK = (
    "<think>\nThe user wants the weather in Paris; I should call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
LLAMA31 = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
LLAMA_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TWO = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"zone": "CET"}}'
)
PY_ONE = '[get_user_info(user_id=7890, special="black")]'
PY_TWO = '[get_weather(city="San Francisco", metric="celsius"), get_time(zone=None, exact=true)]'
PY_LLAMA4 = '<|python_start|>[get_weather(city="Tokyo", days=[1, 2])]<|python_end|>'

CALLS = {
    "hermes": [
        (QWEN_ONE, None, [("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
        (
            QWEN_TWO,
            None,
            [
                ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
                ("get_current_wind_speed", {"location": "San Francisco, CA, USA"}),
            ],
        ),
        (
            QWEN3_THINK,
            "<think>\nThe user wants the weather in Paris; I should call the tool.\n</think>",
            [("get_weather", {"city": "Paris", "unit": "celsius"})],
        ),
        (
            "Let me look that up.\n" + QWEN_ONE + "\nOne moment.",
            "Let me look that up.\n\nOne moment.",
            [("get_current_temperature", {"location": "San Francisco, CA, USA"})],
        ),
    ],
    "llama3_json": [
        (
            LLAMA31,
            None,
            [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
        ),
        (LLAMA_TAG, None, [("get_weather", {"city": "Paris"})]),
        (LLAMA_TWO, None, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        (
            LLAMA_TAG + " Then I will tell you.",
            " Then I will tell you.",
            [("get_weather", {"city": "Paris"})],
        ),
    ],
    "pythonic": [
        (PY_ONE, None, [("get_user_info", {"user_id": 7890, "special": "black"})]),
        (
            PY_TWO,
            None,
            [
                ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
                ("get_time", {"zone": None, "exact": True}),
            ],
        ),
        (PY_LLAMA4, None, [("get_weather", {"city": "Tokyo", "days": [1, 2]})]),
    ],
}

# Replies that are not (or not wholly) calls: the text comes back as content, exactly.
NOT_CALLS = {
    "hermes": [
        "The weather in Paris is sunny.",
        QWEN_ONE[:-5],  # cut short by max_tokens
        QWEN_ONE[: QWEN_ONE.index("location")],
        "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
        "<tool_call>\n" + "[" * 5000 + "\n</tool_call>",
        "a < b and <tool_ is not a tag",
        "",
    ],
    "llama3_json": [
        "The weather in Paris is sunny.",
        LLAMA31[:-3],
        LLAMA_TAG[:20],
        '{"location": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}, "extra": 1}',
        '{"name": "get_weather", "parameters": "Paris"}',
        "{" * 5000,
        "<|python_tag|>print('hi')",
        "  \n",
    ],
    "pythonic": [
        "The weather in Paris is sunny.",
        PY_ONE[:-2],
        "[1, 2, 3] are numbers",
        '[get_weather("Paris")]',  # positional arguments are not calls
        "[get_weather(city=open('/etc/passwd'))]",
        "[get_weather(**kw)]",
        "[]",
        "[" * 5000,
        "<|python_start|>[f(a=1)",
    ],
}


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser_cls, text, sizes, max_calls=None):
    """(content, [(name, arguments text)], ids) reassembled from the streamed deltas."""
    stream = DeltaStream(parser_cls(), max_calls)
    deltas, at, k = [], 0, 0
    while at < len(text):
        size = sizes[k % len(sizes)]
        deltas += stream.push(text[at : at + size])
        at, k = at + size, k + 1
    deltas += stream.finish()
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in tc:
            assert entry["id"] is None and tc["type"] == "function"
            assert tc["id"].startswith("call_") and tc["function"]["arguments"] == ""
            entry["id"], entry["name"] = tc["id"], tc["function"]["name"]
        entry["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


CASES = [(name, *case) for name, cases in CALLS.items() for case in cases]


@pytest.mark.parametrize(("parser", "text", "content", "want"), CASES)
def test_calls_in_each_familys_format(parser, text, content, want):
    got_content, calls = extract(PARSERS[parser](), text)
    assert got_content == content
    assert _calls(calls) == want
    assert all(c.arguments == json.dumps(json.loads(c.arguments)) for c in calls)


NOT_CASES = [(name, text) for name, texts in NOT_CALLS.items() for text in texts]


@pytest.mark.parametrize(("parser", "text"), NOT_CASES)
def test_malformed_or_cut_short_replies_are_content(parser, text):
    assert extract(PARSERS[parser](), text) == (text, [])
    assert _stream(PARSERS[parser], text, [1]) == (text, [])


@pytest.mark.parametrize(("parser", "text"), [(c[0], c[1]) for c in CASES] + NOT_CASES)
def test_streamed_deltas_reassemble_into_the_extracted_calls(parser, text):
    content, calls = extract(PARSERS[parser](), text)
    want = [(c.name, c.arguments) for c in calls]
    rng = random.Random(0)
    for sizes in ([1], [2], [3, 1, 7], [len(text) or 1], [rng.randint(1, 9) for _ in range(50)]):
        got_content, got = _stream(PARSERS[parser], text, sizes)
        assert got == want, sizes
        assert got_content == (content or ""), sizes


def test_hermes_partial_tag_is_held_until_decided():
    stream = DeltaStream(PARSERS["hermes"]())
    assert stream.push("Sure <tool") == [{"content": "Sure"}]
    assert stream.push("_c") == []
    assert stream.push("ar is a word") == [{"content": " <tool_car is a word"}]
    assert stream.finish() == []


def test_max_calls_keeps_the_first_call_only():
    content, calls = extract(PARSERS["hermes"](), QWEN_TWO, max_calls=1)
    assert content is None and [c.name for c in calls] == ["get_current_temperature"]
    _, streamed = _stream(PARSERS["hermes"], QWEN_TWO, [4], max_calls=1)
    assert streamed == [(c.name, c.arguments) for c in calls]


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        get_parser("mistral")


GRAMMAR_REPLIES = [
    (lambda: NamedCallParser("get_weather"), '{"city": "Paris", "days": 2}', 1),
    (lambda: NamedCallParser("get_weather"), '{"city": "Par', 1),  # cut by max_tokens: a call
    (
        ArrayCallsParser,
        '[{"name": "get_time", "arguments": {"zone": "CET"}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        2,
    ),
    (ArrayCallsParser, '[{"name": "get_time", "arguments": {"zone": "C', 1),
    (ArrayCallsParser, '[{"name": "get_ti', 0),  # cut before a name: content
    # keys in either order; a cut name is told by the functions it may call
    (lambda: ArrayCallsParser(("get_time", "get_weather")), '[{"arguments": {}, "name": "get_t', 1),
    (lambda: ArrayCallsParser(("get_time",)), '[{"arguments": {"zone": "C', 1),
    (lambda: ArrayCallsParser(("get_time", "get_weather")), '[{"arguments": {"zone": "C', 0),
    (ArrayCallsParser, '[{"name": "get_time", "arguments": {}}, {"name": "get_w', 1),
]


@pytest.mark.parametrize(("parser", "text", "count"), GRAMMAR_REPLIES)
def test_grammar_constrained_replies(parser, text, count):
    content, calls = extract(parser(), text)
    assert len(calls) == count
    if not count:
        assert content == text
    for sizes in ([1], [5], [len(text)]):
        got_content, got = _stream(parser, text, sizes)
        assert got == [(c.name, c.arguments) for c in calls]
        assert got_content == (content or "")
