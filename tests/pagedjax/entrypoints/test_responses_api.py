"""/v1/responses, OpenAI's Responses API as vLLM serves it, on a tiny random model with a
byte-level tokenizer (its text is whatever the constraint allows, so each answer is checked
against the constraint): text whole and streamed, function tools (required, named, and the
conversation sent back with function_call and function_call_output items), structured output
through ``text.format``, the refusals, and the OpenAI Agents SDK running an agent with a function
tool and a structured output on its default API (no set_default_openai_api call)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest
from server_helpers import KEY, assert_openai_error, live_server, make_byte_model, raw

from pagedjax import LLM
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.tools import ToolConfig

MODEL = "tiny-bytes"
CITY = {"type": "string", "minLength": 2, "maxLength": 6, "pattern": "^[a-z]+$"}
WEATHER = {
    "type": "object",
    "properties": {"city": CITY},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": WEATHER,
        "strict": True,
    }
]


class Forecast(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=6, pattern="^[a-z]+$")
    sunny: bool


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses_bytes")
    make_byte_model(path)
    llm = LLM(str(path), block_size=8, num_blocks=300, max_model_len=256, seed=0)
    tools = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with live_server(
        build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY, tool_config=tools))
    ) as url:
        yield url


def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY)


def test_text_whole_and_streamed(base):
    c = client(base)
    ask = dict(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=12)
    r = c.responses.create(**ask, extra_body={"seed": 7})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    text = r.output_text
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(c.responses.create(stream=True, **ask, extra_body={"seed": 7}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text  # the same seed: the same text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == r.usage.output_tokens


def test_vllms_responses_client_flow(base):
    """examples/online_serving/openai_responses_client.py: a response, its reasoning items (none
    from this model) sent back, a second response."""
    c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60.0, max_retries=3)
    input_messages = [{"role": "user", "content": "What model are you?"}]
    response = c.responses.create(model=MODEL, input=input_messages, max_output_tokens=16)
    for message in response.output:
        if message.type == "reasoning":
            input_messages.append(message)
    response_2 = c.responses.create(model=MODEL, input=input_messages, max_output_tokens=16)
    assert isinstance(response_2.output_text, str) and response_2.usage.output_tokens > 0


def test_vllms_tool_client_flow_required_then_answered(base):
    """examples/online_serving/openai_responses_client_with_tools.py's flow."""
    c = client(base)
    input_messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    r = c.responses.create(
        model=MODEL,
        input=input_messages,
        tools=TOOLS,
        tool_choice="required",
        extra_body={"seed": 1},
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed", r
    tool_call = calls[0]
    args = json.loads(tool_call.arguments)
    jsonschema.validate(args, WEATHER)
    input_messages.append(tool_call)
    input_messages.append(
        {"type": "function_call_output", "call_id": tool_call.call_id, "output": "20 C"}
    )
    r2 = c.responses.create(model=MODEL, input=input_messages, tools=TOOLS, max_output_tokens=8)
    assert r2.output and r2.output[0].type == "message"
    # a named function, streamed: its arguments arrive as deltas
    named = {"type": "function", "name": "get_weather"}
    events = list(
        c.responses.create(
            model=MODEL,
            input="weather?",
            tools=TOOLS,
            tool_choice=named,
            stream=True,
            extra_body={"seed": 2},
        )
    )
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args
    jsonschema.validate(json.loads(args), WEATHER)
    assert events[-1].response.output[0].arguments == args


def test_structured_output_through_text_format(base):
    c = client(base)
    fmt = {
        "type": "json_schema",
        "name": "forecast",
        "schema": Forecast.model_json_schema(),
        "strict": True,
    }
    for seed in (0, 1):
        r = c.responses.create(
            model=MODEL,
            input="A forecast.",
            text={"format": fmt},
            extra_body={"seed": seed},
            max_output_tokens=80,
        )
        assert r.status == "completed", r
        Forecast.model_validate_json(r.output_text)
    parsed = c.responses.parse(
        model=MODEL, input="A forecast.", text_format=Forecast, extra_body={"seed": 3}
    )
    assert isinstance(parsed.output_parsed, Forecast)


def test_what_this_server_cannot_do_is_refused_naming_the_field(base):
    ok = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    cases = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"unknown_field": 1}, "unknown_field"),
    ]
    for extra, param in cases:
        status, body = raw(base, "POST", "/v1/responses", {**ok, **extra})
        assert_openai_error(status, body, 400, param=param)
    status, body = raw(base, "POST", "/v1/responses", {**ok, "store": True, "include": []})
    assert status == 200 and json.loads(body)["store"] is False


def test_the_agents_sdk_runs_an_agent_with_a_function_tool_and_structured_output(base):
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    set_default_openai_client(openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY))
    asked: list[str] = []

    @function_tool  # its argument bounded: a random model's strings run long
    def get_weather(city: Annotated[str, pydantic.Field(max_length=6, pattern="^[a-z]+$")]) -> str:
        """The weather of a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    agent = Agent(
        name="forecaster",
        instructions="Look the weather up, then answer.",
        model=MODEL,
        tools=[get_weather],
        output_type=Forecast,
        # the first turn must call the tool; the SDK resets the choice after it (its default)
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            extra_body={"seed": 4},
        ),
    )

    async def both():  # one event loop: the client's connections belong to it
        result = await Runner.run(agent, "What is the weather in Paris?")
        run = Runner.run_streamed(agent, "And in Rome?")
        kinds = [event.type async for event in run.stream_events()]
        return result, run, kinds

    result, run, kinds = asyncio.run(both())
    assert isinstance(result.final_output, Forecast), result.final_output
    assert len(asked) >= 2 and all(isinstance(city, str) for city in asked)
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"]
    assert items[-1] == "message_output_item"
    assert isinstance(run.final_output, Forecast)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
