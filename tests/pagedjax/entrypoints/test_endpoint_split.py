"""The OpenAI server split by endpoint, read from the source and checked on the objects: no
``chat`` flag threads through openai/ (each endpoint answers through its response shape), no
openai/ module over 450 lines, each endpoint's request becomes one frozen GenerationJob through
its request class (its own token limit and logprobs fields), and the shape alone decides what
differs between a completion's and a chat completion's answer."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from pagedjax.entrypoints.openai.job import GenerationJob
from pagedjax.entrypoints.openai.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ServerLimits,
)
from pagedjax.entrypoints.openai.request_params import ParamsContext, engine_params
from pagedjax.entrypoints.openai.response_shapes import ChatShape, CompletionShape, Echo
from pagedjax.entrypoints.openai.responses import Responses, StreamEvents
from pagedjax.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedjax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedjax.entrypoints.openai.serving_engine import OpenAIServing
from pagedjax.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

OPENAI = Path(__file__).resolve().parents[3] / "pagedjax" / "entrypoints" / "openai"
MAX_MODULE_LINES = 450
CONTEXT = ParamsContext(ServerLimits(), {}, vocab_size=100)


def _modules() -> dict[str, str]:
    return {p.relative_to(OPENAI).as_posix(): p.read_text() for p in sorted(OPENAI.rglob("*.py"))}


def _is_flag_parameter(node: ast.arg) -> bool:
    """A parameter named ``chat`` that is no other thing: ``chat: bool`` or unannotated (a
    ``chat: dict`` body is not a flag)."""
    hint = node.annotation
    return node.arg == "chat" and (hint is None or ast.unparse(hint) == "bool")


def _stored(node: ast.Attribute) -> bool:
    return isinstance(node.ctx, ast.Store)


def chat_flags(source: str) -> list[str]:
    """Each ``chat`` flag in ``source``: a ``chat: bool`` (or unannotated ``chat``) parameter,
    a ``chat=True|False`` argument, a ``.chat =`` attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and _is_flag_parameter(node):
            found.append(f"line {node.lineno}: parameter chat")
        elif isinstance(node, ast.keyword) and node.arg == "chat":
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, bool):
                found.append(f"line {node.value.lineno}: argument chat=")
        elif isinstance(node, ast.Attribute) and node.attr == "chat" and _stored(node):
            found.append(f"line {node.lineno}: attribute .chat")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def test_the_flag_check_finds_what_it_looks_for():
    code = "def f(x, chat: bool):\n    self.chat = chat\n    g(chat=True)\ndef h(chat): ...\n"
    assert chat_flags(code) == [
        "line 1: parameter chat",
        "line 2: attribute .chat",
        "line 3: argument chat=",
        "line 4: parameter chat",
    ]
    # a chat request, a chat body or a chat endpoint's object is no flag
    assert chat_flags("def f(chat: dict): ...\nchat = parse(body)\nEndpoints(chat=x)\n") == []


def test_no_chat_flag_in_openai():
    found = {path: f for path, text in _modules().items() if (f := chat_flags(text))}
    assert found == {}


def test_no_openai_module_over_450_lines():
    sizes = {path: len(text.splitlines()) for path, text in _modules().items()}
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_each_endpoint_is_its_own_serving_class_over_the_shared_base():
    for cls in (OpenAIServingCompletion, OpenAIServingChat, OpenAIServingTokenization):
        assert issubclass(cls, OpenAIServing)
    assert hasattr(OpenAIServingCompletion, "create_completion")
    assert hasattr(OpenAIServingChat, "create_chat_completion")
    assert hasattr(OpenAIServingTokenization, "create_tokenize")


# ---- a request becomes one frozen job ----------------------------------------------------------


def test_a_whole_answer_job_asks_the_engine_for_final_outputs_only():
    req = CompletionRequest(model="m", prompt="hi", n=2, priority=3)
    params = engine_params(req, 5, "max_tokens", None, "response_format", CONTEXT)
    job = GenerationJob.of(req, [[1, 2]], params, CompletionShape(), None)
    assert job.params.output_kind == RequestOutputKind.FINAL_ONLY
    assert (job.n, job.priority, job.stream, job.prompts) == (2, 3, None, ([1, 2],))
    assert job.response_id.startswith("cmpl-") and job.created > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.priority = 0


def test_a_streamed_job_carries_its_stream_options():
    data = {"stream": True, "stream_options": {"include_usage": True}}
    req = ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **data}
    )
    params = engine_params(req, 5, "max_tokens", None, "response_format", CONTEXT)
    job = GenerationJob.of(req, [[1]], params, ChatShape(), None)
    assert job.params.output_kind == RequestOutputKind.CUMULATIVE
    assert job.stream.include_usage and not job.stream.continuous_usage
    assert job.response_id.startswith("chatcmpl-")


def test_each_request_class_names_its_own_token_limit_and_logprobs():
    messages = [{"role": "user", "content": "hi"}]
    chat = ChatRequest(model="m", messages=messages, logprobs=True, top_logprobs=3)
    assert chat.logprobs_k() == 3 and chat.logprobs_field == "top_logprobs"
    chat = ChatRequest(model="m", messages=messages, max_tokens=4, max_completion_tokens=6)
    assert chat.requested_max_tokens() == (6, "max_completion_tokens")
    with pytest.raises(APIError) as e:
        ChatRequest(model="m", messages=messages, top_logprobs=2).logprobs_k()
    assert e.value.param == "top_logprobs"
    # a completion's echoed prompt is scored with its logprobs' k
    echoed = CompletionRequest(model="m", prompt="hi", echo=True, logprobs=2, prompt_logprobs=1)
    params = engine_params(echoed, 3, "max_tokens", None, "response_format", CONTEXT)
    assert isinstance(params, SamplingParams)
    assert (params.logprobs, params.prompt_logprobs) == (2, 2)
    beams = CompletionRequest(model="m", prompt="hi", n=2, use_beam_search=True)
    params = engine_params(beams, 3, "max_tokens", None, "response_format", CONTEXT)
    assert isinstance(params, BeamSearchParams) and params.beam_width == 2


# ---- the shape decides what differs ------------------------------------------------------------


def _finished(rid: str, text: str, ids: list[int]) -> RequestOutput:
    c = CompletionOutput(0, text, ids, -1.0, None, "stop", None)
    return RequestOutput(rid, None, [7, 8], [c], True)


def _job(shape, stream=False) -> GenerationJob:
    req = CompletionRequest(model="m", prompt="hi", stream=stream)
    return GenerationJob.of(req, [[7, 8]], SamplingParams(max_tokens=4), shape, None)


def test_the_shape_builds_each_endpoint_s_whole_body():
    responses = Responses(None, [0], "served")
    final = _finished("r", "ok", [5, 6])
    echo = Echo(("hi",), only=False)
    text = json.loads(responses.final_body(_job(CompletionShape(echo=echo)), [final]))
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-")
    assert text["choices"][0]["text"] == "hiok" and "message" not in text["choices"][0]
    chat_job = _job(ChatShape(echo="so "))
    body = responses.final_body(chat_job, [final])
    chat = json.loads(chat_job.shape.finish_body(body))
    assert chat["object"] == "chat.completion" and chat["model"] == "served"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "so ok"}
    assert (
        text["usage"]
        == chat["usage"]
        == {
            "prompt_tokens": 2,
            "completion_tokens": 2,
            "total_tokens": 4,
        }
    )


def test_the_shape_builds_each_endpoint_s_stream():
    responses = Responses(None, [0], "served")
    final = _finished("r", "ok", [5, 6])
    completion = StreamEvents(responses, _job(CompletionShape(), stream=True), ["r"])
    assert completion.opening() == []
    (event,) = completion.events(final)
    chunk = json.loads(event[len("data: ") :])
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "ok"
    chat = StreamEvents(responses, _job(ChatShape(), stream=True), ["r"])
    (opening,) = chat.opening()
    assert json.loads(opening[len("data: ") :])["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    (event,) = chat.events(final)
    chunk = json.loads(event[len("data: ") :])
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"] == {"content": "ok"}
