"""vLLM's structured-output clients against a live server, rewritten only in their model and
max_tokens: examples/online_serving/structured_outputs/structured_outputs.py (guided_choice,
guided_regex, a json_schema response_format, guided_grammar and a structural_tag
response_format; whole and streamed), openai_chat_completion_structured_outputs.py (the guided_*
client) and openai_chat_completion_structured_outputs_structural_tag.py; plus xgrammar's newer
structural tag form, and the guided fields' refusals. The model is a tiny random one with a
byte-level tokenizer: its text is whatever the constraint allows, so each answer is checked
against the constraint itself."""

from __future__ import annotations

import asyncio
import enum
import json
import re

import jsonschema
import openai
import pydantic
import pytest
from server_helpers import KEY, assert_openai_error, live_server, make_byte_model, raw

from pagedjax import LLM
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

MODEL = "tiny-bytes"
MAX_TOKENS = 120


class CarType(str, enum.Enum):  # noqa: UP042 (as the example writes it)
    SEDAN = "SEDAN"
    SUV = "SUV"
    TRUCK = "TRUCK"
    COUPE = "COUPE"


class CarDescription(pydantic.BaseModel):
    # bounded, ASCII and closed: a random model's strings run long, in any script, and it would
    # add properties of its own
    model_config = pydantic.ConfigDict(extra="forbid")
    brand: str = pydantic.Field(max_length=8, pattern="^[A-Za-z]+$")
    model: str = pydantic.Field(max_length=8, pattern="^[A-Za-z0-9]+$")
    car_type: CarType


WEATHER_PROMPT = "what is the weather in New York City, Boston, and San Francisco?"
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10, "pattern": "^[A-Za-z ]+$"}},
    "required": ["city"],
}
SQL_GBNF = """
root ::= select_statement

select_statement ::= "SELECT " column " from " table " where " condition

column ::= "col_1 " | "col_2 "

table ::= "table_1 " | "table_2 "

condition ::= column "= " number

number ::= "1 " | "2 "
"""
SQL_LARK = """
    ?start: select_statement

    ?select_statement: "SELECT " column_list " FROM " table_name

    ?column_list: column_name ("," column_name)*

    ?table_name: identifier

    ?column_name: identifier

    ?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/
"""
# structured_outputs.py's PARAMS (its messages shortened, its json strings bounded)
PARAMS = {
    "choice": {
        "messages": [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
        "extra_body": {"guided_choice": ["positive", "negative"]},
    },
    "regex": {
        "messages": [{"role": "user", "content": "An email address for Alan Turing."}],
        "extra_body": {"guided_regex": r"[a-z0-9.]{1,20}@\w{6,10}\.com\n"},
    },
    "json": {
        "messages": [{"role": "user", "content": "The most iconic car from the 90's, as JSON"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "car-description",
                "schema": CarDescription.model_json_schema(),
            },
        },
    },
    "grammar": {
        "messages": [{"role": "user", "content": "An SQL query on the users table."}],
        "extra_body": {"guided_grammar": SQL_GBNF},
    },
    "structural_tag": {
        "messages": [{"role": "user", "content": WEATHER_PROMPT}],
        "response_format": {
            "type": "structural_tag",
            "structures": [
                {"begin": "<function=get_weather>", "schema": CITY_SCHEMA, "end": "</function>"}
            ],
            "triggers": ["<function="],
        },
    },
}
SQL_GBNF_RE = re.compile(
    r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"
)
EMAIL_PREFIX = r"[^\s@.]+(@[^\s@.]*(\.(c(om?)?)?)?)?"
SQL_LARK_RE = r"SELECT \w+(,\w+)* FROM \w+"
SQL_LARK_PREFIX = r"(S(E(L(E(C(T( (\w+(,(\w+)?)*( (F(R(O(M( \w*)?)?)?)?)?)?)?)?)?)?)?)?)?)?"
CALL = re.compile(r"<function=get_weather>(.*?)</function>", re.S)


def check_structural_tag(text: str) -> None:
    """Every tag the text opens is a complete call whose arguments meet the schema."""
    for args in CALL.findall(text):
        jsonschema.validate(json.loads(args), CITY_SCHEMA)
    assert text.count("<function=") == len(CALL.findall(text)), text


CHECKS = {
    "choice": lambda t: t in ("positive", "negative"),
    "regex": lambda t: re.fullmatch(PARAMS["regex"]["extra_body"]["guided_regex"], t),
    "json": lambda t: CarDescription.model_validate_json(t),
    "grammar": lambda t: SQL_GBNF_RE.fullmatch(t),
    "structural_tag": lambda t: check_structural_tag(t) or True,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("so_clients")
    make_byte_model(path)
    llm = LLM(str(path), block_size=8, num_blocks=300, max_model_len=256, seed=0)
    with live_server(build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))) as url:
        yield url


def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY)


def test_vllms_structured_outputs_example_whole_and_streamed(base):
    async def run(stream: bool) -> dict[str, str]:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY)
        model = (await c.models.list()).data[0].id
        calls = [
            c.chat.completions.create(
                model=model, max_tokens=MAX_TOKENS, stream=stream, seed=i, **PARAMS[name]
            )
            for i, name in enumerate(PARAMS)
        ]
        results = await asyncio.gather(*calls)
        if not stream:
            return {n: r.choices[0].message.content for n, r in zip(PARAMS, results, strict=True)}
        out = {}
        for name, s in zip(PARAMS, results, strict=True):
            out[name] = "".join([ch.choices[0].delta.content or "" async for ch in s])
        return out

    whole, streamed = asyncio.run(run(False)), asyncio.run(run(True))
    for name, check in CHECKS.items():
        assert check(whole[name]), (name, whole[name])
        assert streamed[name] == whole[name], name  # the same seed: the same text


def test_the_guided_client(base):
    c = client(base)
    model = c.models.list().data[0].id
    ask = {"model": model, "max_tokens": MAX_TOKENS, "seed": 0}
    msgs = [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}]
    r = c.chat.completions.create(
        messages=msgs, extra_body={"guided_choice": ["positive", "negative"]}, **ask
    )
    assert r.choices[0].message.content in ("positive", "negative")
    # the example's regex and grammar are unbounded: a random model may stop at max_tokens,
    # with a prefix of what they allow
    r = c.chat.completions.create(
        messages=msgs, extra_body={"guided_regex": r"\w+@\w+\.com\n", "stop": ["\n"]}, **ask
    )
    (choice,) = r.choices
    email = r"[^\s@.]+@[^\s@.]+\.com" if choice.finish_reason == "stop" else EMAIL_PREFIX
    assert re.fullmatch(email, choice.message.content), choice
    r = c.chat.completions.create(
        messages=msgs, extra_body={"guided_json": CarDescription.model_json_schema()}, **ask
    )
    CarDescription.model_validate_json(r.choices[0].message.content)
    r = c.chat.completions.create(messages=msgs, extra_body={"guided_grammar": SQL_LARK}, **ask)
    (choice,) = r.choices
    sql = SQL_LARK_RE if choice.finish_reason == "stop" else SQL_LARK_PREFIX
    assert re.fullmatch(sql, choice.message.content), choice
    # the completions endpoint takes them too, and the whitespace pattern shapes the JSON
    r = c.completions.create(
        model=model,
        prompt="A car:",
        max_tokens=MAX_TOKENS,
        extra_body={
            "guided_json": CarDescription.model_json_schema(),
            "guided_whitespace_pattern": r"\n",
        },
    )
    text = r.choices[0].text
    CarDescription.model_validate_json(text)
    assert ", " not in text and text.count("\n") >= 2, text


def test_the_structural_tag_examples_old_and_new_forms(base):
    c = client(base)
    msgs = [{"role": "user", "content": WEATHER_PROMPT}]
    r = c.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=MAX_TOKENS,
        response_format=PARAMS["structural_tag"]["response_format"],
    )
    check_structural_tag(r.choices[0].message.content)
    # the newer form, as vLLM documents it
    tag = {
        "begin": "<function=get_weather>",
        "content": {"type": "json_schema", "json_schema": CITY_SCHEMA},
        "end": "</function>",
    }
    newer = {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [tag]},
    }
    r = c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, extra_body={"response_format": newer}
    )
    check_structural_tag(r.choices[0].message.content)
    # a call and nothing else: the tag is forced from the first token
    forced = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [tag],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
    for seed in range(3):
        r = c.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=MAX_TOKENS,
            seed=seed,
            extra_body={"response_format": forced},
        )
        (choice,) = r.choices
        assert choice.finish_reason == "stop", choice
        assert CALL.fullmatch(choice.message.content), choice
        check_structural_tag(choice.message.content)


def test_guided_fields_are_refused_naming_the_field(base):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    cases = [
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "one kind of guided"),
        (
            {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
            "guided_json",
            "give response_format or guided_json, not both",
        ),
        (
            {"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
            "guided_decoding_backend",
            None,
        ),
        ({"guided_choice": []}, "guided_choice", "guided_choice: choice must be"),
        (
            {"guided_regex": "a", "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            None,
        ),
        ({"guided_json": "{not json"}, "guided_json", "guided_json: json is not valid JSON"),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "token"}}},
            "response_format",
            "'token' format is not supported",
        ),
    ]
    for extra, param, contains in cases:
        status, body = raw(base, "POST", "/v1/chat/completions", {**chat, **extra})
        assert_openai_error(status, body, 400, param=param, contains=contains)
    status, body = raw(
        base, "POST", "/v1/chat/completions", {**chat, "guided_decoding_backend": "guidance"}
    )
    assert status == 200, body
