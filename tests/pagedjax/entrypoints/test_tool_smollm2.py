"""Tool calling with the embedded SmolLM2-135M-Instruct, through the official openai client: 100
calls with tool_choice naming the function (50 streamed, 50 not), every one parsing and
validating against the function's schema; then the calls go back with tool messages and the
model answers in text."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from server_helpers import live_server

from pagedjax import LLM
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

pytestmark = pytest.mark.slow

KEY = "smol-tools"
MODEL = "smollm2"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city for the next days.",
            "parameters": WEATHER,
        },
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Tokyo", "Cairo", "Quebec", "Perth", "Bern", "Hanoi"]
ASKS = ["What is the weather in {} this week?", "Will it rain in {} tomorrow?"]


async def _one(client, i: int, stream: bool):
    city = CITIES[i % len(CITIES)]
    messages = [{"role": "user", "content": ASKS[(i // len(CITIES)) % len(ASKS)].format(city)}]
    ask = dict(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=80,
        temperature=0.8,
        seed=i,
    )
    if not stream:
        r = await client.chat.completions.create(**ask)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        return messages, call.id, call.function.name, call.function.arguments
    calls, finish = {}, None
    async for chunk in await client.chat.completions.create(stream=True, **ask):
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": None, "arguments": ""})
            entry["name"] = entry["name"] or tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0], (finish, calls)
    return messages, calls[0]["id"], calls[0]["name"], calls[0]["arguments"]


def test_100_named_calls_parse_and_validate():
    llm = LLM(max_model_len=512, num_blocks=512, max_num_seqs=16, seed=0)
    app = build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))

    async def run(base):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=600)
        gate = asyncio.Semaphore(16)

        async def gated(i):
            async with gate:
                return await _one(client, i, stream=i % 2 == 1)

        results = await asyncio.gather(*(gated(i) for i in range(100)))
        answers = []
        for messages, call_id, name, arguments in results[:4]:
            history = [
                *messages,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": '{"forecast": "sunny"}'},
            ]
            r = await client.chat.completions.create(
                model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0
            )
            answers.append(r.choices[0].message)
        return results, answers

    with live_server(app) as base:
        results, answers = asyncio.run(run(base))
    valid = 0
    for _, call_id, name, arguments in results:
        assert call_id.startswith("call_") and name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)
        valid += 1
    assert valid == 100
    for message in answers:
        assert message.tool_calls is None and message.content


# A tool as LangChain sends it (bind_tools([get_weather], tool_choice="get_weather")): its
# parameters name their properties and say nothing of others.
LANGCHAIN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a location.",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}},
                "required": ["location"],
            },
        },
    }
]


def test_a_langchain_named_choice_is_answered_with_its_call():
    """The grammar holds the arguments to the named property (vLLM's default grammar backend
    does): the model cannot ramble in an extra one until max_tokens, and every answer is a
    tool call with exactly its arguments."""
    llm = LLM(max_model_len=512, num_blocks=256, max_num_seqs=8, seed=0)
    app = build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))
    with live_server(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=600)
        for i, city in enumerate(CITIES[:6]):
            r = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"What's the weather like in {city}?"}],
                tools=LANGCHAIN_TOOLS,
                tool_choice=NAMED,
                max_tokens=48,
                temperature=0.8,
                seed=i,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and choice.message.content is None
            assert set(json.loads(call.function.arguments)) == {"location"}
    llm.close()
