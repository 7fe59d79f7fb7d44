"""Tool calling on a live server over a tiny byte-level model, through the official openai
client: tools -> tool_calls -> a "tool" message -> a final answer, streamed and not; "required"
and named choices decoded under the functions' schemas (every call parses and validates); "auto"
read by the hermes parser; 400s naming the bad field."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import Field
from server_helpers import assert_openai_error, live_server, make_byte_model, raw

from pagedjax import LLM
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.protocol import APIError, ChatRequest, parse_request
from pagedjax.entrypoints.openai.tools import ToolConfig, tool_mode

KEY = "tools-key"
MODEL = "tiny-tools"
# Renders what Qwen's template does, shortly: the tools, each call (arguments as an object) and
# each tool answer with its call id.
CHAT_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}>"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} of a place", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools_llama")
    make_byte_model(path, CHAT_TEMPLATE)
    llm = LLM(str(path), block_size=8, num_blocks=200, max_model_len=256, seed=0)
    config = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    app = build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY, tool_config=config))
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base, tokenizer=llm.tokenizer)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def streamed(client, **kwargs):
    """(content, [(name, arguments)], finish_reason) of one streamed choice, reassembled."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
            if tc.id:
                assert entry["id"] is None and tc.id.startswith("call_") and tc.type == "function"
                entry["id"], entry["name"] = tc.id, tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


def test_named_choice_call_then_tool_answer(server, client):
    ask = dict(messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=80, temperature=0)
    r = client.chat.completions.create(model=MODEL, **ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)
    # streamed: the same call (greedy), as delta.tool_calls
    content, calls, finish = streamed(client, **ask)
    assert (content, finish) == ("", "tool_calls")
    assert calls == [(call.function.name, call.function.arguments)]
    # the call and the tool's answer go back; the model answers in text
    history = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)
    assert final.choices[0].finish_reason in ("stop", "length")
    want = server.tokenizer.apply_chat_template(
        [
            *USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.loads(call.function.arguments),
                        },
                    }
                ],
            },
            history[2],
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<call>get_weather{" in want and f"#{call.id}" in want
    assert final.usage.prompt_tokens == len(
        server.tokenizer(want, add_special_tokens=False)["input_ids"]
    )
    _, _, finish = streamed(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert finish in ("stop", "length")


@pytest.mark.parametrize("parallel", [False, True])
def test_required_choice_calls_validate(client, parallel):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=200,
        temperature=1.0,
        seed=3,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 if not parallel else len(calls) >= 1
    for call in calls:
        check_call(call)
    assert len({c.id for c in calls}) == len(calls)


# the hermes text a Qwen model writes, forced here by a regex the tiny model must follow
HERMES = (
    'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
)


def _forced(text):
    escaped = "".join("\\" + c if c in "{}[]().*+?|\\^$" else c for c in text)
    return {"structured_outputs": {"regex": escaped}}


@pytest.mark.parametrize("parallel", [None, False])
def test_auto_choice_reads_the_hermes_text(client, parallel):
    ask = dict(
        messages=USER,
        tools=TOOLS,
        max_tokens=200,
        extra_body=_forced(HERMES),
    )
    if parallel is not None:
        ask["parallel_tool_calls"] = parallel
    r = client.chat.completions.create(model=MODEL, **ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    want = [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert got == (want if parallel is None else want[:1])
    content, calls, finish = streamed(client, **ask)
    assert (content, finish) == ("Checking.", "tool_calls")
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_choice_without_calls_is_text(client):
    text = "<tool_call>\nnot json\n</tool_call>"
    ask = dict(messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=60)
    r = client.chat.completions.create(model=MODEL, extra_body=_forced(text), **ask)
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    assert streamed(client, extra_body=_forced(text), **ask) == (text, [], "stop")


def _chat(**fields):
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def _tool(name, parameters=None, **extra):
    fn = {"name": name, **extra}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


BAD = [
    ({"tools": [_tool("f", {"type": "array"})]}, "tools.0.function.parameters"),
    ({"tools": [_tool("f", [1])]}, "tools.0.function.parameters"),
    ({"tools": [_tool("f"), _tool("f")]}, "tools.1.function.name"),
    ({"tools": [_tool("has space")]}, "tools.0.function.name"),
    ({"tools": [_tool("f", color=1)]}, "tools.0.function.color"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (
        {
            "tools": [_tool("f", {"type": "object", "properties": {"a": {"type": 5}}})],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{"},
                        }
                    ],
                },
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_tools_are_400s_naming_the_field(server, fields, param):
    body = _chat(**fields)
    assert_openai_error(
        *raw(server.base, "POST", "/v1/chat/completions", body, key=KEY), 400, param=param
    )


def test_auto_needs_the_servers_flag():
    req = parse_request(ChatRequest, _chat(tools=TOOLS, tool_choice="auto"))
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:
        tool_mode(req, ToolConfig(), None)
    assert e.value.param == "tool_choice"
    # left out, tool_choice is "auto" only where the server serves it
    req = parse_request(ChatRequest, _chat(tools=TOOLS))
    assert tool_mode(req, ToolConfig(), None)[1] is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        ToolConfig(tool_call_parser="nope")


def test_openai_agents_sdk_calls_a_tool_then_answers(server):
    """The OpenAI Agents SDK, unmodified, against this server: its forced tool call runs the
    Python function, the result goes back as a tool message, the model answers in text."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(
        city: Literal["Paris", "Rome", "Oslo"], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The weather of a city for some days."""
        seen.append((city, days))
        return f"sunny in {city}"

    def agent():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
        return agents.Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(
                tool_choice="get_weather", max_tokens=40, temperature=0
            ),
        )

    result = agents.Runner.run_sync(agent(), "Weather in Paris?", max_turns=3)
    assert len(seen) == 1 and seen[0][0] in ("Paris", "Rome", "Oslo") and 1 <= seen[0][1] <= 7
    assert isinstance(result.final_output, str)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == 1 and outputs[0].output == f"sunny in {seen[0][0]}"

    async def streamed():
        run = agents.Runner.run_streamed(agent(), "Weather in Paris?", max_turns=3)
        async for _ in run.stream_events():
            pass
        return run

    run = asyncio.run(streamed())
    assert seen[1] == seen[0]  # greedy: the same call, streamed
    assert isinstance(run.final_output, str)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--enable-auto-tool-choice"], "--tool-call-parser"),
        (["--tool-call-parser", "nope"], "hermes, llama3_json, pythonic"),
    ],
)
def test_serve_refuses_bad_tool_flags_before_loading(flags, says, capsys):
    from pagedjax.cli import main

    assert main(["serve", "--model", "/nonexistent", *flags]) == 2
    assert says in capsys.readouterr().err
