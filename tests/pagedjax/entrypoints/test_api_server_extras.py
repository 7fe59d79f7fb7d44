"""On a live server over a tiny byte-level model: /v1/completions echo with logprobs (what
lm-evaluation-harness's local-completions sends to score a prompt), vLLM's prompt_logprobs,
logit_bias, best_of, and structured output (response_format, structured_outputs) on both
endpoints."""

from __future__ import annotations

import json
import re
import types

import jsonschema
import numpy as np
import openai
import pytest
from server_helpers import (
    assert_openai_error,
    byte_llm,
    live_server,
    raw,
    sse_events,
)

from pagedjax import SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

KEY = "scoring-key"
MODEL = "tiny-bytes"
PROMPT = "The cat sat."
K = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = byte_llm(tmp_path_factory, "scoring_llama", max_model_len=96)
    ids = llm.tokenizer(PROMPT)["input_ids"]
    ref = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=K), use_tqdm=False)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    gen_ref = llm.generate(ids, greedy, use_tqdm=False)[0].outputs[0].text
    app = build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))
    with live_server(app) as base:
        yield types.SimpleNamespace(
            base=base,
            ids=ids,
            prompt_logprobs=ref.prompt_logprobs,
            gen_ref=gen_ref,
            tokenizer=llm.tokenizer,
        )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, body, path="/v1/completions"):
    return raw(server.base, "POST", path, {"model": MODEL, **body}, key=KEY)


def check_prompt_part(server, lp, n_prompt):
    assert lp["tokens"][:n_prompt] == list(PROMPT)  # one byte a token
    assert lp["text_offset"][:n_prompt] == list(range(n_prompt))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, n_prompt):
        entry = server.prompt_logprobs[j]
        token = server.ids[j]
        assert abs(lp["token_logprobs"][j] - entry[token].logprob) < 1e-5
        top = lp["top_logprobs"][j]
        # The token itself and the K most likely (lm-eval's is_greedy reads the max of these).
        want = {t for t, e in entry.items() if e.rank <= K} | {token}
        assert set(top) == {server.tokenizer.decode([t]) for t in want}
        assert max(top.values()) == pytest.approx(max(e.logprob for e in entry.values()), abs=1e-5)


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_echo_scores_the_prompt_with_max_tokens_0(server, as_ids):
    prompt = server.ids if as_ids else PROMPT
    status, body = post(
        server, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": K, "temperature": 0}
    )
    assert status == 200, body
    r = json.loads(body)
    choice = r["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT)
    check_prompt_part(server, lp, len(PROMPT))
    assert r["usage"]["completion_tokens"] == 0
    assert r["usage"]["prompt_tokens"] == len(server.ids)


def test_echo_with_generation_and_streaming(server, client):
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        echo=True,
        logprobs=K,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert c.text == PROMPT + server.gen_ref
    lp = c.logprobs.model_dump()
    assert len(lp["tokens"]) == len(PROMPT) + 4
    check_prompt_part(server, lp, len(PROMPT))
    assert all(v is not None for v in lp["token_logprobs"][len(PROMPT) :])
    assert lp["text_offset"][len(PROMPT)] == len(PROMPT)
    # The same as a stream: the prompt comes first, then the completion.
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": K, "temperature": 0}
    status, data = post(server, {**body, "stream": True, "ignore_eos": True})
    assert status == 200
    events = [e for e in sse_events(data) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == c.text
    tokens = [
        t
        for e in events
        if e["choices"][0]["logprobs"]
        for t in e["choices"][0]["logprobs"]["tokens"]
    ]
    assert tokens == lp["tokens"]
    # Echo without logprobs: the text alone.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None


def check_vllm_prompt_logprobs(server, entries, k):
    """vLLM's prompt_logprobs: None, then per token its own and the k likeliest by id."""
    assert len(entries) == len(server.ids) and entries[0] is None
    for j in range(1, len(server.ids)):
        ref, token = server.prompt_logprobs[j], server.ids[j]
        want = {t for t, e in ref.items() if e.rank <= k} | {token}
        assert set(entries[j]) == {str(t) for t in want}
        for t in want:
            got = entries[j][str(t)]
            assert got["logprob"] == pytest.approx(ref[t].logprob, abs=1e-5)
            assert got["rank"] == ref[t].rank
            assert got["decoded_token"] == server.tokenizer.decode([t])


def test_prompt_logprobs_field_on_both_endpoints(server):
    status, body = post(server, {"prompt": PROMPT, "max_tokens": 1, "n": 2, "prompt_logprobs": K})
    assert status == 200, body
    choices = json.loads(body)["choices"]
    for choice in choices:  # on each choice of the prompt
        check_vllm_prompt_logprobs(server, choice["prompt_logprobs"], K)
    # with echo's logprobs (fewer alternatives): both, each with its own k
    fields = {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1, "prompt_logprobs": K}
    status, body = post(server, fields)
    (choice,) = json.loads(body)["choices"]
    check_vllm_prompt_logprobs(server, choice["prompt_logprobs"], K)
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    # chat: once, for the rendered conversation
    messages = [{"role": "user", "content": "Hi"}]
    fields = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    status, body = post(server, fields, "/v1/chat/completions")
    out = json.loads(body)
    entries = out["prompt_logprobs"]
    assert len(entries) == out["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(e) in (1, 2) for e in entries[1:])  # its own, and the likeliest if not it
    assert "prompt_logprobs" not in out["choices"][0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_return_tokens_as_token_ids(server, stream):
    """vLLM's: logprobs name each token "token_id:N" (here N is the token's byte)."""
    fields = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    fields |= {"logprobs": 2, "return_tokens_as_token_ids": True, "stream": stream}

    def read(fields):
        status, body = post(server, fields)
        assert status == 200, body
        if not stream:
            (choice,) = json.loads(body)["choices"]
            return choice["logprobs"]["tokens"], choice["text"], choice["logprobs"]["top_logprobs"]
        chunks = [e["choices"][0] for e in sse_events(body) if e != "[DONE]" and e["choices"]]
        lps = [c["logprobs"] for c in chunks if c["logprobs"]]
        tops = [top for lp in lps for top in lp["top_logprobs"]]
        return [t for lp in lps for t in lp["tokens"]], "".join(c["text"] for c in chunks), tops

    tokens, text, tops = read(fields)
    plain_tokens, plain_text, _ = read(fields | {"return_tokens_as_token_ids": False})
    assert text == plain_text == server.gen_ref  # the text itself is unchanged
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert [server.tokenizer.decode([i]) for i in ids] == plain_tokens
    assert all(k.startswith("token_id:") for top in tops for k in top)
    messages = [{"role": "user", "content": "Hi"}]
    fields = {"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    fields |= {"return_tokens_as_token_ids": True, "ignore_eos": True, "temperature": 0}
    status, body = post(server, fields, "/v1/chat/completions")
    for entry in json.loads(body)["choices"][0]["logprobs"]["content"]:
        token_id = int(entry["token"].removeprefix("token_id:"))
        assert entry["bytes"] == [token_id]  # the token's own bytes, not its name's


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt_logprobs": 1, "stream": True},  # vLLM's: not with streaming
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
    ],
)
def test_bad_prompt_logprobs_are_400s(server, fields):
    status, body = post(server, {"prompt": PROMPT, "max_tokens": 1, **fields})
    assert_openai_error(status, body, 400, param="prompt_logprobs")


def test_logit_bias_forces_a_token_on_both_endpoints(server, client):
    a = str(ord("A"))
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias={a: 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == "AAAAA"
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        logit_bias={a: 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == "AAAAA"
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(ord("z")): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content == "zzz"


def test_best_of_returns_the_most_likely_samples(server, client):
    common = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    every = client.completions.create(n=4, **common).choices
    scores = [sum(c.logprobs.token_logprobs) for c in every]
    best = client.completions.create(n=2, best_of=4, **common)
    assert len(best.choices) == 2 and [c.index for c in best.choices] == [0, 1]
    order = np.argsort(scores)[::-1][:2]
    assert [c.text for c in best.choices] == [every[i].text for i in order]
    assert best.usage.completion_tokens == 4 * 6


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"260": 1}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_fields_are_400s(server, fields, param):
    assert_openai_error(*post(server, {"prompt": PROMPT, **fields}), 400, param=param)


# ---- structured output ----------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def chat_body(**fields):
    messages = [{"role": "user", "content": "A city, as JSON"}]
    return {"messages": messages, "max_tokens": 60, **fields}


def test_chat_response_format_json_schema_and_object(server, client):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = client.chat.completions.create(
        model=MODEL, n=2, temperature=1.0, seed=1, response_format=rf, **chat_body()
    )
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    # Streamed, the same constraint holds across the deltas.
    stream = client.chat.completions.create(
        model=MODEL, temperature=0, response_format=rf, stream=True, **chat_body()
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    r = client.chat.completions.create(
        model=MODEL, temperature=0, response_format={"type": "json_object"}, **chat_body()
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_on_both_endpoints(server, client):
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=20,
        temperature=1.0,
        seed=2,
        n=3,
        extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,5}!"}},
    )
    assert all(re.fullmatch("[A-Z][a-z]{2,5}!", c.text) for c in r.choices)
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        **chat_body(),
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}},
    )
    assert r.choices[0].message.content in ("Paris", "Rome")
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'start: "<" /[a-c]+/ ">"'}},
    )
    assert re.fullmatch("<[a-c]+>", r.choices[0].text)


@pytest.mark.parametrize(
    "path, fields, param, says",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
            "JSON schema",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "type"),
        ("/v1/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex"),
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": "start: ("}},
            "structured_outputs",
            "grammar",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"pattern": "a"}},
            "structured_outputs",
            "unknown field",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "not both",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_what_is_wrong(server, path, fields, param, says):
    body = chat_body(**fields) if "chat" in path else {"prompt": PROMPT, **fields}
    assert_openai_error(*post(server, body, path), 400, param=param, contains=says)
