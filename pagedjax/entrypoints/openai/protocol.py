"""What the server accepts, strictly: JSON (finite numbers, valid Unicode, bounded nesting), the
request bodies with their types and bounds, and the OpenAI fields refused because they are not
implemented. Everything here raises APIError; nothing here touches the engine."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Annotated, Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedjax.engine.client import DEFAULT_MAX_QUEUE
from pagedjax.entrypoints.chat_template import ChatOptions

MAX_JSON_DEPTH = 32  # a chat body with content parts needs 5


# ---- errors ---------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self) -> Response:
        return error_response(self.status, self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str | None = None, param=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status, message, type_="invalid_request_error", code=None, param=None):
    # json.dumps escapes non-ASCII, so a message quoting client text always encodes.
    body = json.dumps(error_body(message, type_, code, param))
    headers = {"Connection": "close"} if status == 408 else None
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


# ---- limits ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds the engine's own config does not already imply."""

    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting for admission before new ones get 503
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # the whole body must arrive within this
    max_stop_strings: int = 64  # stop strings per request (and stop_token_ids)
    max_stop_string_chars: int = 1024
    # Logprob entries (a token's own and each alternative) one response may carry, counted up
    # front from the request: echo and logprobs turn a small body into a huge response.
    max_response_logprobs: int = 1 << 20

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")


# ---- JSON -----------------------------------------------------------------------------------


def parse_json(body: bytes) -> Any:
    """Strict JSON: no NaN/Infinity, no lone surrogates, at most MAX_JSON_DEPTH levels."""
    try:
        # NaN and Infinity parse here, so that the walk below refuses them naming their field
        data = json.loads(body)
    except RecursionError:
        raise bad_request(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer over 4300 digits
        raise bad_request(f"the body is not valid JSON: {e}") from None
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise bad_request(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            _check_unicode(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{_loc(path)}: numbers must be finite", _loc(path))
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_unicode(k, path)
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))
    return data


def _check_unicode(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        loc = _loc(path)
        raise bad_request(
            f"{loc}: a string holds a lone surrogate at position {e.start} (not valid Unicode)",
            loc or None,
        ) from None


def _loc(path) -> str:
    return ".".join(str(p) for p in path) if path else "body"


# ---- request bodies (OpenAI's fields, plus a few of vLLM's extras) ---------------------------

# Integers up to what a 64-bit seed needs; smaller bounds come from SamplingParams and the engine.
Int = Annotated[int, Field(ge=-(2**63), lt=2**64)]
Float = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk its choice's


class GenerationRequest(_Strict):
    """What completions and chat completions share."""

    model: str
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0  # vLLM's: no stop before this many tokens
    include_stop_str_in_output: bool = False  # vLLM's: the stop string or token stays in the text
    skip_special_tokens: bool = True  # vLLM's: special tokens leave no text
    use_beam_search: bool = False  # vLLM's: the n best of n beams, best first
    length_penalty: Float = 1.0  # beams ranked by cumulative logprob / length ** this
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens as "token_id:N"
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's logprob and the k likeliest
    truncate_prompt_tokens: Int | None = None  # vLLM's: the prompt's last k tokens (-1: all fit)
    stop_token_ids: list[Int] | None = None
    user: str | None = None
    best_of: Int | None = None  # generate best_of, return the n of highest cumulative logprob
    logit_bias: dict[str, Float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[Int] | None = None  # vLLM's: only these can be sampled
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": {...}, ...}}
    response_format: dict[str, Any] | None = None
    # vLLM's: exactly one of json (a schema), regex, choice, grammar, json_object
    structured_outputs: dict[str, Any] | None = None
    priority: Int = 0  # vLLM's, with --scheduling-policy priority: lower values served first
    # vLLM's older spellings of structured_outputs (guided.py): one of these, ...
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    # ... and the JSON's whitespace and the backend (llguidance's, or "auto")
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16  # 0 only with echo (the prompt alone, e.g. to score it)
    logprobs: Int | None = None
    echo: bool = False  # the prompt comes back before the completion (with logprobs: its too)
    suffix: str | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the token limit asked for, None if unset; the field that holds it)."""
        return self.max_tokens, "max_tokens"

    def logprobs_k(self) -> int | None:
        """Alternatives per generated token's logprobs (None: no logprobs)."""
        return self.logprobs

    @property
    def logprobs_field(self) -> str:
        """The field a refused logprobs request is named by."""
        return "logprobs"

    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine scores: vLLM's prompt_logprobs, or echo's
        logprobs (the echoed prompt's), whichever is more."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)]
        asked = [k for k in asked if k is not None]
        return max(asked) if asked else None


class ChatMessage(_Strict):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None  # a "tool" message's answer to this call


class _ChatTemplateFields(_Strict):
    """vLLM's chat template options (chat_template.ChatOptions)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatRequest(GenerationRequest, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = False  # vLLM's: a last assistant message comes back before the reply
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the token limit asked for, None if unset; the field that holds it:
        max_completion_tokens over the older max_tokens)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def logprobs_k(self) -> int | None:
        """Alternatives per generated token's logprobs (None: no logprobs); top_logprobs
        without logprobs is a 400."""
        if self.logprobs:
            return self.top_logprobs or 0
        if self.top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None

    @property
    def logprobs_field(self) -> str:
        """The field a refused logprobs request is named by."""
        return "top_logprobs" if self.top_logprobs else "logprobs"

    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine scores (vLLM's prompt_logprobs)."""
        return self.prompt_logprobs


# field -> the values that ask for nothing this server lacks
_NEUTRAL: dict[str, tuple] = {
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
}


def parse_request(model_cls: type[GenerationRequest], data: Any) -> GenerationRequest:
    """Validate a parsed body; unknown fields and unsupported values are 400s naming them."""
    req = parse_body(model_cls, data)
    _refuse_unsupported(req)
    return req


def parse_body(model_cls: type[BaseModel], data: Any):
    """``data`` validated as ``model_cls``; an unknown field or a bad value is a 400 naming it."""
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field {loc!r}", param=loc) from None
        raise bad_request(f"{loc}: {err['msg']}", param=loc) from None


class TokenizeCompletionRequest(_Strict):  # POST /tokenize with a prompt (vLLM's)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplateFields):  # POST /tokenize with messages
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):  # POST /detokenize
    model: str | None = None
    tokens: list[Int]


def chat_options(req: _ChatTemplateFields) -> ChatOptions:
    """The request's chat template options; a bad combination is a 400 naming the field."""
    try:
        return ChatOptions(
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            chat_template_kwargs=req.chat_template_kwargs,
        )
    except ValueError as e:
        raise bad_request(str(e), str(e).split(":", 1)[0].split()[0]) from None


class LoadLoRAAdapterRequest(_Strict):  # /v1/load_lora_adapter (vLLM's)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):  # /v1/unload_lora_adapter
    lora_name: str
    lora_int_id: Int | None = None  # vLLM's, accepted; the name decides


def unsupported_field(req: BaseModel, neutral: dict[str, tuple]) -> str | None:
    """The first field of ``req`` set to a value that is not one of ``neutral``'s for it (None
    is always neutral; a boolean equals only itself: False is not 0), else None."""
    for name, values in neutral.items():
        value = getattr(req, name, None)
        if value is not None and not any(_same(value, v) for v in values):
            return name
    return None


def _same(value, neutral) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _refuse_unsupported(req: GenerationRequest) -> None:
    if (name := unsupported_field(req, _NEUTRAL)) is not None:
        raise bad_request(f"{name} is not supported by this server", name)
    if req.n < 1:  # checked here, not only by SamplingParams: best_of stands in for it there
        raise bad_request(f"n must be at least 1, got {req.n}", "n")
    if req.best_of is not None and req.best_of < req.n:
        raise bad_request(f"best_of must be at least n={req.n}, got {req.best_of}", "best_of")
    if req.stream and (req.best_of or req.n) > req.n:
        raise bad_request("best_of greater than n cannot be streamed", "best_of")
    k = req.truncate_prompt_tokens
    if k is not None and not (k == -1 or k >= 1):  # checked before the prompt is tokenized
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or at least 1, got {k}", "truncate_prompt_tokens"
        )
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available when streaming", "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream: true", "stream_options")


def chat_echo(req: ChatRequest) -> str:
    """vLLM's chat echo: the text the reply continues (the last message's, when it is the
    assistant's), sent before it; "" without echo."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    return chat_messages(req)[-1]["content"]


def chat_messages(req: ChatRequest) -> list[dict]:
    """The conversation as the chat template takes it: text only, content parts joined."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = enumerate(content)
            content = "".join(_text_part(p, f"messages.{i}.content.{j}") for j, p in parts)
        message = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:  # checked and shaped for the template by tools.template_messages
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def _text_part(part: Any, loc: str) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise bad_request(f"{loc}: a content part must be an object with a string 'type'", loc)
    kind = part["type"]
    if kind != "text":
        raise bad_request(
            f"{loc}: {kind!r} content parts are not supported (this server takes text only)",
            f"{loc}.type",
        )
    if not isinstance(part.get("text"), str):
        raise bad_request(f"{loc}.text: a text part's 'text' must be a string", f"{loc}.text")
    extra = sorted(set(part) - {"type", "text"})
    if extra:
        raise bad_request(f"{loc}: unknown field {extra[0]!r}", f"{loc}.{extra[0]}")
    return part["text"]
