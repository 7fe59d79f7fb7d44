"""Tool schemas as clients write them (pagedjax/entrypoints/openai/tool_schemas.py): pydantic's
``$defs`` under tool_choice "required" (hoisted to the root; one name defined two ways refused
naming it), other local references rewritten, objects held to their named properties (in the
grammar too), and a forced reply cut by max_tokens still answered as ``tool_calls``, whole and
streamed, on a live server over a tiny byte-level model."""

from __future__ import annotations

import json
import types
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import live_server, make_byte_model

from pagedjax import LLM
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.protocol import APIError, ChatRequest, parse_request
from pagedjax.entrypoints.openai.tool_parsers.base import ParsedCall
from pagedjax.entrypoints.openai.tool_parsers.json_calls import cut_call
from pagedjax.entrypoints.openai.tool_schemas import close_objects, required_calls_schema
from pagedjax.entrypoints.openai.tools import ToolConfig, tool_mode
from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.structured_output.grammar import GrammarCompiler

MODEL = "tiny-tool-schemas"
USER = [{"role": "user", "content": "Plan it"}]


class Place(BaseModel):
    city: str = Field(max_length=4)
    country: Literal["FR", "IT"]


class Trip(BaseModel):
    start: Place
    stops: list[Place] = Field(max_length=1)


class Forecast(BaseModel):
    place: Place
    days: int = Field(ge=1, le=3)


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


PYDANTIC_TOOLS = [
    tool("plan_trip", Trip.model_json_schema()),
    tool("forecast", Forecast.model_json_schema()),
]
TRIP = {"start": {"city": "Rome", "country": "IT"}, "stops": [{"city": "Nice", "country": "FR"}]}


def forced_schema(tools, choice="required", parallel=None) -> dict:
    body = {"model": "m", "messages": USER, "tools": tools, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    _, mode = tool_mode(parse_request(ChatRequest, body), ToolConfig(), None)
    return mode.constraint.json


def test_required_schema_hoists_pydantic_defs():
    schema = forced_schema(PYDANTIC_TOOLS)
    assert set(schema["$defs"]) == {"Place"}  # both tools define it the same way: once
    for item in schema["items"]["anyOf"]:
        assert "$defs" not in item["properties"]["arguments"]
    calls = [
        {"name": "plan_trip", "arguments": TRIP},
        {"name": "forecast", "arguments": {"place": TRIP["start"], "days": 2}},
    ]
    jsonschema.validate(calls, schema)  # every $ref resolves from the root
    bad = [{"name": "forecast", "arguments": {"place": {"city": "Rome"}, "days": 2}}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)  # Place's own rules hold through the hoisted $ref
    assert PYDANTIC_TOOLS[0]["function"]["parameters"]["$defs"]  # the request's own untouched


def test_one_name_defined_two_ways_is_refused_naming_it():
    other = Trip.model_json_schema()
    other["$defs"]["Place"]["properties"]["city"]["maxLength"] = 9
    with pytest.raises(APIError) as e:
        forced_schema([PYDANTIC_TOOLS[1], tool("plan_trip", other)])
    assert e.value.status == 400 and e.value.param == "tools.1.function.parameters"
    assert "'Place'" in e.value.message and "tools.0" in e.value.message


def test_draft7_definitions_and_references_into_a_tool_are_rewritten():
    tree = {  # a recursive schema: "#" is the tool's own root
        "type": "object",
        "properties": {
            "label": {"$ref": "#/definitions/Label"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
            "copy": {"$ref": "#/properties/label"},
        },
        "required": ["label"],
        "definitions": {"Label": {"type": "string", "maxLength": 3}},
    }
    schema = required_calls_schema([{"name": "tree", "parameters": tree}], None)
    assert schema["$defs"] == {"Label": {"type": "string", "maxLength": 3}}
    good = {"label": "a", "kids": [{"label": "b", "kids": [{"label": "c"}]}], "copy": "d"}
    jsonschema.validate([{"name": "tree", "arguments": good}], schema)
    for bad in ({"label": "long!"}, {"label": "a", "kids": [{"label": "a", "x": 1}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "tree", "arguments": bad}], schema)


def test_objects_are_held_to_their_named_properties():
    open_schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "free": {"type": "object"},  # names no property: stays free-form
            "extra": {"type": "object", "properties": {}, "additionalProperties": True},
            "both": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
        },
    }
    closed = close_objects(open_schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["extra"]["additionalProperties"] is True
    assert all("additionalProperties" not in s for s in props["both"]["allOf"])
    jsonschema.validate({"both": {"x": 1, "y": 2}, "free": {"z": 1}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {"b": "x", "c": 1}}, closed)
    assert "additionalProperties" not in open_schema  # a copy
    deep: dict = {"type": "object", "properties": {}}
    node = deep
    for _ in range(5000):  # no recursion, whatever the nesting
        node["properties"]["n"] = {"type": "object", "properties": {}}
        node = node["properties"]["n"]
    assert close_objects(deep)["additionalProperties"] is False


def test_a_cut_call_is_told_by_its_name_or_what_there_is_of_it():
    two = ("get_time", "get_weather")
    for text, names, want in [
        ('{"name": "get_time", "arguments": {"zone": "C', two, ("get_time", '{"zone": "C')),
        ('{"arguments": {"zone": "CET"}, "name": "get_t', two, ("get_time", '{"zone": "CET"}')),
        ('{"arguments": {"zone": "C', ("get_time",), ("get_time", '{"zone": "C')),
        ('{"name": "get_', ("get_time",), ("get_time", "")),
        ('{"arguments": {"zone": "C', two, None),
        ('{"name": "get_', two, None),
        ('{"name": "nope", "arguments": {', two, ("nope", "{")),  # its own name, as written
    ]:
        assert cut_call(text, names) == (None if want is None else ParsedCall(*want)), text


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_schemas")
    make_byte_model(path)
    llm = LLM(str(path), block_size=8, num_blocks=300, max_model_len=512, seed=0)
    app = build_app(EngineLoop(llm.engine), MODEL)
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base, llm=llm)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)


def test_a_named_choice_grammar_refuses_a_property_the_schema_does_not_name(server):
    """LangChain's tools carry no additionalProperties: the model may not add any."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema = forced_schema([tool("get_weather", weather)], NAMED)
    llm = server.llm
    compiled = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size).compile(
        StructuredOutputsParams(json=schema)
    )
    for text, fits in [('{"city": "Paris"}', True), ('{"city": "Paris", "description', False)]:
        matcher = compiled.new_matcher()
        ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert (matcher.try_consume_tokens(ids) == len(ids)) is fits, text


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_required_choice_with_pydantic_tools_is_answered(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=PYDANTIC_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    model = {"plan_trip": Trip, "forecast": Forecast}[call.function.name]
    model.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_cut_by_max_tokens_is_still_a_tool_call(client, choice):
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ask = dict(
        messages=USER, tools=[tool("get_weather", weather)], tool_choice=choice, temperature=0
    )
    ask["max_tokens"] = 12 if choice == NAMED else 32  # cut inside the arguments
    r = client.chat.completions.create(model=MODEL, **ask)
    (out,) = r.choices
    assert out.finish_reason == "length" and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)  # as far as it got
    stream = client.chat.completions.create(model=MODEL, stream=True, **ask)
    deltas, finish = [], None
    for chunk in stream:
        (c,) = chunk.choices
        assert not c.delta.content
        deltas += c.delta.tool_calls or []
        finish = c.finish_reason or finish
    assert finish == "length" and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
