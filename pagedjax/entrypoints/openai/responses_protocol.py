"""/v1/responses (OpenAI's Responses API, as vLLM serves it): the request body, and the chat
completion request it runs as. ``input`` (a string, or items: messages, ``function_call`` and
``function_call_output``), ``instructions``, function ``tools`` and ``tool_choice``,
``text.format`` (text, json_schema, json_object) and the sampling fields become the chat
request's messages, tools, response_format and fields, so that everything a chat request does
(templates, tool calling, structured output, limits, metrics) a response does too.

A required or named tool_choice decides the reply's grammar (a call) over ``text.format``
(which the answer after the call follows), as in vLLM. This server stores no responses:
``store`` is taken and answered false, and what needs a stored response
(``previous_response_id``, ``conversation``, item references, ``background``) is a 400 naming
the field, as are tools other than functions and inputs other than text.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from pagedjax.entrypoints.openai.protocol import Float, Int, _Strict, bad_request

# fields whose value must be one of these (None always is): what this server can do
_NEUTRAL = {
    "previous_response_id": (),
    "conversation": (),
    "prompt": (),
    "background": (False,),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "context_management": (),
}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    include: list[str] | None = None
    top_logprobs: Int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    truncation: str | None = None
    max_tool_calls: Int | None = None
    context_management: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # vLLM's extras
    priority: Int = 0
    seed: Int | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    stop: str | list[str] | None = Field(default=None)


def chat_body(req: ResponsesRequest) -> dict:
    """The chat completion request ``req`` runs as (a dict, validated as ChatRequest after)."""
    for name, values in _NEUTRAL.items():
        value = getattr(req, name)
        if value is not None and value not in values:
            raise bad_request(
                f"{name} is not supported by this server (it stores no responses, "
                "and answers in one pass)",
                name,
            )
    for item in req.include or []:
        if item != "message.output_text.logprobs":
            raise bad_request(f"include: {item!r} is not available from this server", "include")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages(req),
        "stream": req.stream,
        "priority": req.priority,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.user is not None:
        body["user"] = req.user
    if req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or []):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    response_format = _response_format(req.text)
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    if response_format is not None and not forced:  # a forced call's grammar wins (vLLM's)
        body["response_format"] = response_format
    return body


def messages(req: ResponsesRequest) -> list[dict]:
    """The conversation as chat messages: instructions first (system), then the input's items
    (consecutive function calls join one assistant message, as chat templates expect)."""
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for i, item in enumerate(req.input):
        loc = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{loc}: an input item must be an object", loc)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, loc))
        elif kind == "function_call":
            call = _function_call(item, loc)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_function_output(item, loc))
        elif kind == "reasoning":
            continue  # a reasoning model's summary: not shown to the template again
        else:
            raise bad_request(
                f"{loc}: input items of type {kind!r} are not supported", f"{loc}.type"
            )
    if not out:
        raise bad_request("input must hold at least one message", "input")
    return out


def _message(item: dict, loc: str) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(
            f"{loc}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{loc}.role"
        )
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(p, f"{loc}.content.{j}") for j, p in enumerate(content))
    if not isinstance(content, str):
        raise bad_request(
            f"{loc}.content must be a string or a list of text parts", f"{loc}.content"
        )
    return {"role": _ROLES[role], "content": content}


def _text_part(part, loc: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    raise bad_request(
        f"{loc}: {kind!r} content is not supported (this server takes text only)", f"{loc}.type"
    )


def _function_call(item: dict, loc: str) -> dict:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_request(f"{loc}.{name} must be a string", f"{loc}.{name}")
    fn = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": fn}


def _function_output(item: dict, loc: str) -> dict:
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{loc}.call_id must be a string", f"{loc}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_text_part(p, f"{loc}.output.{j}") for j, p in enumerate(output))
    if not isinstance(output, str):
        raise bad_request(f"{loc}.output must be a string", f"{loc}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _chat_tool(tool, i: int) -> dict:
    loc = f"tools.{i}"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise bad_request(f"{loc}: {kind!r} tools are not supported (function tools only)", loc)
    extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if extra:
        raise bad_request(f"{loc}: unknown field {extra[0]!r}", f"{loc}.{extra[0]}")
    fn = {
        k: tool[k]
        for k in ("name", "description", "parameters", "strict")
        if tool.get(k) is not None
    }
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and set(choice) == {"type", "name"}
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(text: dict | None) -> dict | None:
    """``text.format`` as chat's response_format (None: plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                "text.format.schema must be a JSON schema object", "text.format.schema"
            )
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(
        f"text.format.type must be text, json_schema or json_object, got {kind!r}",
        "text.format.type",
    )


def echoed_fields(req: ResponsesRequest) -> dict:
    """What a response repeats of its request."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": req.reasoning,
        "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt},
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": json.loads(json.dumps(req.tools or [])),
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
        "background": False,
        "service_tier": req.service_tier or "default",
        "error": None,
    }
