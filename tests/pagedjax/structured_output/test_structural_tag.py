"""Structural tags (vLLM's response_format type "structural_tag"), both spellings, compiled with
a byte-level tokenizer (every byte one token) and fed whole strings: what each form accepts and
refuses, JSON inside tags in this server's one style, and specs refused naming the bad part."""

from __future__ import annotations

import json

import pytest
from server_helpers import save_byte_tokenizer

from pagedjax.structured_output.grammar import GrammarCompiler
from pagedjax.structured_output.params import StructuredOutputsParams

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DATE = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
# vLLM's structured outputs example (its older form)
LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}],
    "triggers": ["<function="],
}
# vLLM's documentation of xgrammar's newer form
TRIGGERED = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "begin": "<function=get_weather>",
                "content": {"type": "json_schema", "json_schema": CITY},
                "end": "</function>",
            },
            {
                "begin": "<function=get_date>",
                "content": {"type": "json_schema", "json_schema": DATE},
                "end": "</function>",
            },
        ],
    },
}
CALL = '<function=get_weather>{"city": "Boston"}</function>'


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("st_tok")
    save_byte_tokenizer(path, "{{ messages }}")
    tok = AutoTokenizer.from_pretrained(str(path))
    return tok, GrammarCompiler(tok, 260)


def verdict(compiler, spec, text: str) -> str:
    """ "accept" (text whole and complete), "prefix" (could go on), or "reject"."""
    tok, comp = compiler
    compiled = comp.compile(StructuredOutputsParams(structural_tag=spec))
    matcher = compiled.new_matcher()
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        if not matcher.consume_token(t) or matcher.is_error():
            return "reject"
    return "accept" if matcher.is_accepting() else "prefix"


@pytest.mark.parametrize("spec", [LEGACY, TRIGGERED], ids=["structures", "format"])
def test_free_text_and_tags_with_json_of_their_schema(compiler, spec):
    ok = [
        "The weather, please.",
        CALL,
        "Let me check. " + CALL + " and " + CALL + " done",
        "",
    ]
    for text in ok:
        assert verdict(compiler, spec, text) == "accept", text
    bad = [
        '<function=get_weather>{"town": "Boston"}</function>',  # not its schema
        '<function=get_weather>{"city":"Boston"}</function>',  # JSON in another style
        '<function=get_weather>{"city": "Boston"}</funk>',  # a wrong end
        "<function=get_time>{}</function>",  # no tag begins so
    ]
    for text in bad:
        assert verdict(compiler, spec, text) == "reject", text
    assert verdict(compiler, spec, '<function=get_weather>{"city": "Bo') == "prefix"


def test_a_second_tag_of_the_same_trigger(compiler):
    date = '<function=get_date>{"tz": "UTC"}</function>'
    assert verdict(compiler, TRIGGERED, CALL + date) == "accept"
    assert verdict(compiler, LEGACY, date) == "reject"


def test_at_least_one_and_stop_after_first(compiler):
    fmt = dict(TRIGGERED["format"], at_least_one=True, stop_after_first=True)
    spec = {"type": "structural_tag", "format": fmt}
    assert verdict(compiler, spec, "thinking... " + CALL) == "accept"
    assert verdict(compiler, spec, "no call at all") == "prefix"  # it must still call
    assert verdict(compiler, spec, CALL + " more") == "reject"  # nothing after the first


def test_the_composing_formats(compiler):
    spec = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "<think>"},
                {"type": "any_text"},
                {"type": "const_string", "value": "</think>"},
                {
                    "type": "or",
                    "elements": [
                        {"type": "regex", "pattern": r"[0-9]{2}/[0-9]{2}"},
                        {
                            "type": "tags_with_separator",
                            "tags": [
                                {
                                    "type": "tag",
                                    "begin": "<a>",
                                    "content": {"type": "grammar", "grammar": 'start: "x"+'},
                                    "end": ["</a>", "</A>"],
                                }
                            ],
                            "separator": ",",
                            "at_least_one": True,
                        },
                    ],
                },
            ],
        },
    }
    assert verdict(compiler, spec, "<think>hm, well</think>12/34") == "accept"
    assert verdict(compiler, spec, "<think></think><a>xx</a>,<a>x</A>") == "accept"
    assert verdict(compiler, spec, "<think>x</think><a>y</a>") == "reject"
    assert verdict(compiler, spec, "<think>x</think>1/2") == "reject"


def test_specs_refused_naming_what_is_wrong():
    cases = [
        ("not json", "structural_tag is not valid JSON"),
        ({"type": "structural_tag"}, "needs 'format', or 'structures' and 'triggers'"),
        ({"structures": [], "triggers": ["<f"]}, "structural_tag.structures must be a non-empty"),
        (
            {"structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}], "triggers": ["<f"]},
            "structural_tag.structures.0.begin '<g>' must start with exactly one of the triggers",
        ),
        ({"format": {"type": "token", "token": 5}}, "the 'token' format is not supported"),
        ({"format": {"type": "tag_soup"}}, "unknown format type 'tag_soup'"),
        (
            {"format": {"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}},
            "structural_tag.format.style 'qwen_xml' is not supported",
        ),
        (
            {"format": {"type": "sequence", "elements": [{"type": "any_text"}, {"type": "or"}]}},
            "structural_tag.format.elements.0: any_text must end the sequence",
        ),
        ({"format": {"type": "regex", "pattern": 5}}, "structural_tag.format.pattern must be"),
        ({"format": {"type": "plus", "content": {"type": "x"}}}, "format.content: unknown"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            StructuredOutputsParams(structural_tag=spec)


def test_json_text_and_dict_are_the_same_constraint():
    a = StructuredOutputsParams(structural_tag=json.dumps(LEGACY))
    b = StructuredOutputsParams(structural_tag=LEGACY)
    assert a.key() == b.key() and a.kind == "structural_tag"
    with pytest.raises(ValueError, match="give exactly one of"):
        StructuredOutputsParams(structural_tag=LEGACY, regex="a")
