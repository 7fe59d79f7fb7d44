"""Tool calling on /v1/chat/completions: the request's ``tools`` and ``tool_choice`` checked
(400s name the field), the grammar that makes "required" and named choices always parse, the
conversation's tool calls as chat templates take them, and the answer reshaped: a choice whose
text holds calls gets ``tool_calls`` and ``finish_reason: "tool_calls"``, streamed as OpenAI's
``delta.tool_calls``.

- "none": tools are shown to the template, the reply is text.
- "auto" (the server started with ``--enable-auto-tool-choice --tool-call-parser NAME``): the
  reply is read by that parser (tool_parsers/); text that is not a call stays content.
- a named function: the reply is decoded under the function's parameters schema and is its
  arguments.
- "required": the reply is decoded under a schema for a JSON array of ``{"name", "arguments"}``
  (one item when ``parallel_tool_calls`` is false).

The forcing schemas (tool_schemas.py) hold objects to their named properties and move the
tools' ``$defs`` to the root; a forced reply is always answered as ``tool_calls``, one cut by
``max_tokens`` too (its arguments as far as they got, ``finish_reason`` "length").
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedjax.entrypoints.openai.protocol import bad_request
from pagedjax.entrypoints.openai.tool_parsers import (
    DeltaStream,
    ToolParser,
    call_json,
    extract,
    get_parser,
    new_call_id,
)
from pagedjax.entrypoints.openai.tool_parsers.json_calls import ArrayCallsParser, NamedCallParser
from pagedjax.entrypoints.openai.tool_schemas import named_call_schema, required_calls_schema
from pagedjax.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolConfig:
    """The server's tool options: ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None:
            get_parser(self.tool_call_parser)  # a ValueError names the choices
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")


@dataclasses.dataclass
class ToolMode:
    """How one request's replies are read for calls."""

    new_parser: Callable[[], ToolParser]
    max_calls: int | None  # 1 when parallel_tool_calls is false
    constraint: StructuredOutputsParams | None  # the grammar of "required" and named choices

    def stream(self) -> DeltaStream:
        return DeltaStream(self.new_parser(), self.max_calls)

    def final_body(self, body: bytes) -> bytes:
        """A finished chat response with each choice's calls taken out of its text."""
        data = json.loads(body)
        for choice in data["choices"]:
            message = choice["message"]
            content, calls = extract(self.new_parser(), message["content"] or "", self.max_calls)
            if not calls:
                continue
            message["content"] = content
            message["tool_calls"] = [call_json(c, new_call_id()) for c in calls]
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return json.dumps(data, ensure_ascii=False).encode()

    async def events(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A chat stream's events with each choice's calls sent as ``delta.tool_calls``."""
        streams: dict[int, DeltaStream] = {}
        try:
            async for event in events:
                if not event.startswith("data: {"):
                    yield event
                    continue
                data = json.loads(event[len("data: ") :])
                choices = data.get("choices")
                if not choices or "delta" not in choices[0]:
                    yield event
                    continue
                for out in self._choice_chunks(data, streams):
                    yield f"data: {json.dumps(out, ensure_ascii=False)}\n\n"
        finally:
            await events.aclose()  # its own finally aborts what is unfinished

    def _choice_chunks(self, data: dict, streams: dict[int, DeltaStream]) -> list[dict]:
        (choice,) = data["choices"]
        stream = streams.setdefault(choice["index"], self.stream())
        delta = choice["delta"]
        text = delta.get("content")
        if not text and not choice["finish_reason"]:
            return [data]  # the opening role chunk, or logprobs alone
        deltas = stream.push(text) if text else []
        if choice["finish_reason"]:
            deltas += stream.finish()
            if stream.called and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        head = {k: v for k, v in delta.items() if k != "content"}
        if not deltas:
            deltas = [{}]
            if not head and not choice["finish_reason"] and choice.get("logprobs") is None:
                return []
        chunks = []
        for i, d in enumerate(deltas):
            c = dict(choice, delta={**head, **d} if i == 0 else d)
            if i > 0:
                c["logprobs"] = None
            if i < len(deltas) - 1:
                c["finish_reason"] = None
                c["stop_reason"] = None
            chunks.append(dict(data, choices=[c]))
        return chunks


# ---- the request's tools --------------------------------------------------------------------


def check_tools(tools: list[Any] | None) -> list[dict]:
    """The request's tools, each ``{"type": "function", "function": {name, description?,
    parameters?, strict?}}``, the parameters an object schema ({} when left out)."""
    out, seen = [], {}
    for i, tool in enumerate(tools or []):
        loc = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f'{loc}: a tool must be {{"type": "function", "function": {{...}}}}', loc
            )
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise bad_request(f"{loc}: unknown field {extra[0]!r}", f"{loc}.{extra[0]}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{loc}.function must be an object", f"{loc}.function")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise bad_request(
                f"{loc}.function: unknown field {extra[0]!r}", f"{loc}.function.{extra[0]}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(
                f"{loc}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                f"{loc}.function.name",
            )
        if name in seen:
            raise bad_request(
                f"{loc}.function.name: {name!r} is also the name of tools.{seen[name]}",
                f"{loc}.function.name",
            )
        seen[name] = i
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(
                f"{loc}.function.description must be a string", f"{loc}.function.description"
            )
        if "strict" in fn and not isinstance(fn["strict"], bool | None):
            raise bad_request(f"{loc}.function.strict must be a boolean", f"{loc}.function.strict")
        params = fn.get("parameters")
        if params is None:
            params = dict(_EMPTY_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad_request(
                f"{loc}.function.parameters must be a JSON schema of an object "
                '({"type": "object", ...})',
                f"{loc}.function.parameters",
            )
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def _choice(tool_choice: Any, names: list[str], config: ToolConfig) -> str:
    """The choice as a string: "none", "auto", "required", or the function's name."""
    if tool_choice is None:
        return "auto" if names and config.enable_auto_tool_choice else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        ok = set(tool_choice) == {"type", "function"} and tool_choice["type"] == "function"
        if not ok or not isinstance(fn, dict) or set(fn) != {"name"}:
            raise bad_request(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if fn["name"] not in names:
            raise bad_request(
                f"tool_choice names the function {fn['name']!r}, which is not among the tools "
                f"({', '.join(names) or 'none given'})",
                "tool_choice",
            )
        return fn["name"]
    if tool_choice not in ("none", "auto", "required"):
        raise bad_request(
            f'tool_choice must be "none", "auto", "required" or a function, got {tool_choice!r}',
            "tool_choice",
        )
    if tool_choice != "none" and not names:
        raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto" and not config.enable_auto_tool_choice:
        raise bad_request(
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
            "and --tool-call-parser NAME",
            "tool_choice",
        )
    return tool_choice


def tool_mode(req, config: ToolConfig, constraint) -> tuple[list[dict] | None, ToolMode | None]:
    """(the tools for the chat template, how to read the replies) of a chat request; ``None``
    for either when there is nothing to do. ``constraint``: the request's own structured output
    (response_format / structured_outputs), which a forced call cannot share."""
    tools = check_tools(req.tools)
    fns = {t["function"]["name"]: t["function"] for t in tools}
    choice = _choice(req.tool_choice, list(fns), config)
    shown = tools or None
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "none":
        return shown, None
    if choice == "auto":
        return shown, ToolMode(get_parser(config.tool_call_parser), max_calls, None)
    if constraint is not None:
        raise bad_request(
            "a required or named tool_choice cannot be combined with response_format or "
            "structured_outputs",
            "tool_choice",
        )
    if choice == "required":
        schema = required_calls_schema(list(fns.values()), max_calls)
        names = tuple(fns)
        parser = lambda: ArrayCallsParser(names)  # noqa: E731
        return shown, ToolMode(parser, max_calls, StructuredOutputsParams(json=schema))
    grammar = StructuredOutputsParams(json=named_call_schema(fns[choice]["parameters"]))
    return shown, ToolMode(lambda: NamedCallParser(choice), 1, grammar)


# ---- the conversation -----------------------------------------------------------------------


def template_messages(messages: list[dict]) -> list[dict]:
    """The conversation as chat templates take it: an assistant's ``tool_calls`` with their
    arguments as objects (Qwen's and Llama's templates write them with ``tojson``)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            message = {
                **message,
                "tool_calls": [
                    _template_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(calls)
                ],
            }
        out.append(message)
    return out


def _template_call(call: Any, loc: str) -> dict:
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}'
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_request(f"{loc}: a tool call must be {shape}", loc)
    fn = call["function"]
    if not isinstance(fn.get("name"), str):
        raise bad_request(f"{loc}.function.name must be a string", f"{loc}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
    if not isinstance(args, dict):
        raise bad_request(
            f"{loc}.function.arguments must be the text of a JSON object",
            f"{loc}.function.arguments",
        )
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if "id" in call:
        out["id"] = call["id"]
    return out
