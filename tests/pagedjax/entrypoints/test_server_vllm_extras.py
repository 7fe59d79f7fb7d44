"""vLLM's extras on a live server over a tiny byte-level model (each token one byte, so counts and
texts can be checked exactly): the token endpoints (/tokenize, /detokenize), /version and /ping,
the chat template options (add_generation_prompt, continue_final_message, chat_template_kwargs)
on the server and in ``LLM.chat``, ``stream_options.continuous_usage_stats``, and the sampling
fields min_tokens and allowed_token_ids."""

from __future__ import annotations

import json
import types

import pytest
from server_helpers import (
    KEY,
    assert_openai_error,
    live_server,
    make_byte_model,
    raw,
    sse_events,
)

from pagedjax import LLM, BeamSearchParams, SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

MODEL = "tiny-bytes"
# An end-of-turn mark "|" after each message, an opened assistant turn only when asked, and a
# variable of the template's own (chat_template_kwargs) that puts a header first.
TEMPLATE = (
    "{% if header %}[{{ header }}]{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
OWN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # LLM.chat's
CHAT = [{"role": "user", "content": "Say hi"}]
PREFILLED = CHAT + [{"role": "assistant", "content": "Hi th"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenize_bytes")
    make_byte_model(path, TEMPLATE)
    llm = LLM(str(path), block_size=8, num_blocks=200, max_model_len=96, seed=0)
    tok = llm.tokenizer
    # The offline oracle, before the server owns the engine: LLM.chat with the same options.
    refs = {
        "open": llm.chat(PREFILLED, GREEDY, use_tqdm=False)[0],
        "continued": llm.chat(
            PREFILLED,
            GREEDY,
            use_tqdm=False,
            add_generation_prompt=False,
            continue_final_message=True,
        )[0],
        "header": llm.chat(
            CHAT, GREEDY, use_tqdm=False, chat_template_kwargs={"header": "be brief"}
        )[0],
        "own": llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=OWN_TEMPLATE)[0],
        "beams": llm.beam_search(
            [tok("Hello")["input_ids"]], BeamSearchParams(beam_width=3, max_tokens=5)
        )[0],
    }
    app = build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base, tok=tok, refs=refs)


def post(server, path, body, key=KEY):
    status, data = raw(server.base, "POST", path, body, key=key)
    return status, data if status != 200 else json.loads(data)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---- LLM.chat's options -----------------------------------------------------------------------


def test_llm_chat_renders_its_options_as_the_template_does(server):
    refs = server.refs
    assert refs["open"].prompt_token_ids == _ids(
        server.tok, "<user>Say hi|<assistant>Hi th|<assistant>"
    )
    # continued: the assistant's message is left open, no end of turn and no new turn after it
    assert refs["continued"].prompt_token_ids == _ids(server.tok, "<user>Say hi|<assistant>Hi th")
    assert refs["own"].prompt_token_ids == _ids(server.tok, "Say hi")
    assert refs["header"].prompt_token_ids == _ids(server.tok, "[be brief]<user>Say hi|<assistant>")


def test_llm_chat_refuses_both_generation_prompt_and_continuation(server):
    llm = types.SimpleNamespace(tokenizer=server.tok)  # the check comes before any engine work
    with pytest.raises(ValueError, match="continue_final_message"):
        LLM.chat(llm, PREFILLED, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs: 'tokenize'"):
        LLM.chat(llm, CHAT, GREEDY, chat_template_kwargs={"tokenize": True})


# ---- /tokenize and /detokenize ----------------------------------------------------------------


def test_tokenize_a_prompt(server):
    text = "caf\u00e9 \U0001f600"
    status, body = post(server, "/tokenize", {"prompt": text})
    assert status == 200, body
    want = server.tok(text)["input_ids"]
    assert body == {"count": len(want), "max_model_len": 96, "tokens": want, "token_strs": None}
    assert body["count"] == len(text.encode())  # one token a byte
    status, body = post(
        server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}
    )
    assert body["token_strs"] == server.tok.convert_ids_to_tokens(want)
    # a text far longer than the context is still counted (the body's size bounds the work)
    status, body = post(server, "/tokenize", {"prompt": "ab" * 500})
    assert status == 200 and body["count"] == 1000


def test_tokenize_a_conversation_gives_the_ids_chat_completions_runs(server):
    options = {"add_generation_prompt": False, "continue_final_message": True}
    status, body = post(server, "/tokenize", {"messages": PREFILLED, **options})
    assert status == 200, body
    assert body["tokens"] == server.refs["continued"].prompt_token_ids
    # the same options on /v1/chat/completions: the offline continuation, token for token
    request = {"model": MODEL, "messages": PREFILLED, "max_tokens": 6, "temperature": 0}
    request |= {"ignore_eos": True, **options}
    status, chat = post(server, "/v1/chat/completions", request)
    assert status == 200, chat
    assert chat["choices"][0]["message"]["content"] == server.refs["continued"].outputs[0].text
    assert chat["usage"]["prompt_tokens"] == body["count"]
    # and a default request, an opened turn after the assistant's message, is another prompt
    status, plain = post(server, "/tokenize", {"messages": PREFILLED})
    assert plain["tokens"] == server.refs["open"].prompt_token_ids != body["tokens"]


def test_chat_template_kwargs_reach_the_template(server):
    kwargs = {"chat_template_kwargs": {"header": "be brief"}}
    status, body = post(server, "/tokenize", {"messages": CHAT, **kwargs})
    assert body["tokens"] == server.refs["header"].prompt_token_ids
    request = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    status, chat = post(server, "/v1/chat/completions", {**request, "ignore_eos": True, **kwargs})
    assert chat["choices"][0]["message"]["content"] == server.refs["header"].outputs[0].text


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "fields, param, contains",
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "'tokenize'"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
        ({"chat_template_kwargs": ["header"]}, "chat_template_kwargs", None),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt", None),
        ({"chat_template": "{{ messages }}"}, "chat_template", "unknown field"),
    ],
)
def test_bad_chat_template_options_are_400s_naming_them(server, path, fields, param, contains):
    body = {"model": MODEL, "messages": PREFILLED, **fields}
    if path != "/tokenize":
        body["max_tokens"] = 2
    status, data = post(server, path, body)
    assert_openai_error(status, data, 400, param=param, contains=contains)


def test_detokenize_and_its_errors(server):
    text = "Hello, w\u00f6rld"
    ids = server.tok(text)["input_ids"]
    status, body = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and body == {"prompt": text}
    status, body = post(server, "/detokenize", {"tokens": [72, 257]})  # special tokens kept
    assert body == {"prompt": "H</s>"}
    status, body = post(server, "/detokenize", {"tokens": [72, 260]})
    assert_openai_error(status, body, 400, param="tokens", contains="token id 260")
    status, body = post(server, "/detokenize", {"tokens": "Hi"})
    assert_openai_error(status, body, 400, param="tokens")
    status, body = post(server, "/detokenize", {"model": "other", "tokens": [72]})
    assert_openai_error(status, body, 404, contains="other")
    status, body = post(server, "/tokenize", {"prompt": "x", "messages": CHAT})
    assert_openai_error(status, body, 400, param="prompt", contains="unknown field")
    status, body = post(server, "/tokenize", {"prompt": "x"}, key="wrong")
    assert status == 401


def test_version_and_ping(server):
    status, body = raw(server.base, "GET", "/version")
    assert status == 200 and isinstance(json.loads(body)["version"], str)
    assert raw(server.base, "GET", "/version", key=None)[0] == 401
    for method in ("GET", "POST"):  # open to all, as /health is
        assert raw(server.base, method, "/ping", key=None) == (200, b"ok")


# ---- continuous_usage_stats -------------------------------------------------------------------


def _stream(server, path, body):
    status, data = raw(server.base, "POST", path, {"model": MODEL, "stream": True, **body})
    assert status == 200, data
    events = sse_events(data)
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(server, chat):
    if chat:
        prompt, logprobs = {"messages": CHAT}, {"logprobs": True}
        prompt_tokens = len(_ids(server.tok, "<user>Say hi|<assistant>"))
    else:
        prompt, logprobs, prompt_tokens = {"prompt": "Hello"}, {"logprobs": 0}, 5
    body = {**prompt, **logprobs, "max_tokens": 7, "n": 2, "temperature": 1.0, "seed": 3}
    body["ignore_eos"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = _stream(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 14
    seen = {0: 0, 1: 0}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        # the chunk's tokens are its logprobs' entries: the count is the choice's so far
        lp = choice["logprobs"]
        if lp is not None:
            seen[choice["index"]] += len(lp["content"] if chat else lp["tokens"])
        assert usage["completion_tokens"] == seen[choice["index"]]
    assert seen == {0: 7, 1: 7}
    # without include_usage, continuous_usage_stats adds nothing (vLLM's)
    body = {"prompt": "Hello", "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in e for e in _stream(server, "/v1/completions", body))


# ---- min_tokens, allowed_token_ids ------------------------------------------------------------


def test_min_tokens_and_allowed_token_ids_reach_the_engine(server):
    h, i = 72, 105  # "H", "i"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    body |= {"allowed_token_ids": [h, i], "n": 4}
    status, out = post(server, "/v1/completions", body)
    texts = [c["text"] for c in out["choices"]]
    assert status == 200 and all(set(t) <= {"H", "i"} for t in texts) and "H" in "".join(texts)
    # "H" stops a choice, but not before its fifth token
    body |= {"stop_token_ids": [h], "min_tokens": 5}
    status, out = post(server, "/v1/completions", body)
    stopped = [c for c in out["choices"] if c["finish_reason"] == "stop"]
    for c in out["choices"]:  # the stop token leaves no text (vLLM's)
        assert c["text"][:5] == "iiiii" and "H" not in c["text"]
    assert stopped and all(c["stop_reason"] == h for c in stopped)
    # unless asked; and special tokens' text, when not skipped
    body |= {"include_stop_str_in_output": True, "stop_token_ids": [h, 257]}
    body |= {"allowed_token_ids": [h, i, 257], "skip_special_tokens": False}
    status, out = post(server, "/v1/completions", body)
    for c in out["choices"]:
        ends = {h: "H", None: "</s>"}  # EOS (257) is no stop_reason
        if c["finish_reason"] == "stop":
            assert c["text"].endswith(ends[c["stop_reason"]])
    assert {c["finish_reason"] for c in out["choices"]} == {"stop"}


@pytest.mark.parametrize(
    "fields, contains",
    [
        ({"allowed_token_ids": [72, 260]}, "outside the vocabulary"),
        ({"allowed_token_ids": []}, "non-empty"),
        ({"min_tokens": 5, "max_tokens": 4}, "max_tokens=4"),
    ],
)
def test_bad_sampling_extras_are_400s_naming_them(server, fields, contains):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}
    status, data = post(server, "/v1/completions", body)
    assert_openai_error(status, data, 400, param=next(iter(fields)), contains=contains)


def test_truncate_prompt_tokens(server):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    status, out = post(server, "/v1/completions", body | {
        "prompt": "Hello world", "truncate_prompt_tokens": 3, "echo": True
    })  # fmt: skip
    assert status == 200 and out["usage"]["prompt_tokens"] == 3
    assert out["choices"][0]["text"].startswith("rld")  # the prompt that ran, echoed
    status, same = post(server, "/v1/completions", body | {"prompt": "rld"})
    assert same["choices"][0]["text"] == out["choices"][0]["text"][3:]
    status, out = post(server, "/v1/chat/completions", body | {
        "messages": CHAT, "truncate_prompt_tokens": 4
    })  # fmt: skip
    assert status == 200 and out["usage"]["prompt_tokens"] == 4
    # a text far over the context, refused unencoded without truncation, runs its end
    long = {"prompt": "ab" * 200}
    status, data = post(server, "/v1/completions", body | long)
    assert_openai_error(status, data, 400, param="prompt")
    status, out = post(server, "/v1/completions", body | long | {"truncate_prompt_tokens": 10})
    assert status == 200 and out["usage"]["prompt_tokens"] == 10
    for bad in (0, -2):
        status, data = post(
            server, "/v1/completions", body | long | {"truncate_prompt_tokens": bad}
        )
        assert_openai_error(status, data, 400, param="truncate_prompt_tokens")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_echo_returns_the_continued_message_whole(server, stream):
    """vLLM's chat echo with continue_final_message: the prefilled assistant text, then its
    continuation; a last message of the user's is not echoed."""
    continued = server.refs["continued"].outputs[0].text
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True}
    body |= {"stream": stream, "add_generation_prompt": False, "continue_final_message": True}
    for messages, head in [(PREFILLED, "Hi th"), (CHAT, "")]:
        if not head:
            body |= {"add_generation_prompt": True, "continue_final_message": False}
        if stream:
            events = _stream(server, "/v1/chat/completions", body | {"messages": messages})
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        else:
            status, out = post(server, "/v1/chat/completions", body | {"messages": messages})
            text = out["choices"][0]["message"]["content"]
        if head:
            assert text == head + continued
        else:
            assert not text.startswith("Say hi")  # nothing echoed


# ---- use_beam_search --------------------------------------------------------------------------


def test_use_beam_search_returns_the_engines_best_beams(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "n": 3, "use_beam_search": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    beams = server.refs["beams"].outputs
    assert [c["text"] for c in out["choices"]] == [b.text for b in beams]  # best first
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == sum(len(b.token_ids) for b in beams)
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "n": 2, "use_beam_search": True}
    status, out = post(server, "/v1/chat/completions", chat)
    assert status == 200 and len(out["choices"]) == 2, out


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stream": True}, "stream"),
        ({"top_p": 0.5}, "top_p"),
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 0}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 11}, "n"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ],
)
def test_use_beam_search_refuses_what_it_does_not_take(server, fields, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "use_beam_search": True}
    status, data = post(server, "/v1/completions", body | fields)
    assert_openai_error(status, data, 400, param=param)
