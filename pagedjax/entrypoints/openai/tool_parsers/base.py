"""What every tool-call parser shares: the call it yields, a JSON scanner, and the streaming
machinery that turns parsed items into OpenAI's ``delta`` objects.

A parser is a stateful reader of one model output. ``feed(text)`` takes the next piece of text and
returns the items it has decided on: plain text (``str``, the message's content) or a
``ParsedCall``. Text that might still become part of a call is held back until it is decided, and
``finish()`` decides the rest (a call cut short is content). Feeding the output whole or in any
pieces gives the same items, which is what makes the streamed tool calls equal the non-streamed
ones. Parsers never raise on model output: what does not parse is content.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text, as json.dumps writes it (a forced call cut short by
    # max_tokens: its text as far as it got, tool_parsers/json_calls.py)


Item = str | ParsedCall


def call_of(name: Any, arguments: Any) -> ParsedCall | None:
    """A call from a parsed name and arguments, or None unless the name is a non-empty string
    and the arguments a JSON object (or the text of one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    try:
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
    except (ValueError, TypeError, RecursionError):
        return None


def loads(text: str) -> Any:
    """json.loads that answers None for anything that is not JSON (never raises)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class BracketScanner:
    """Finds where the bracket opening at ``text[start]`` closes, resumably: each ``end(text)``
    call scans only what was added since the last one (a long call streamed token by token
    stays linear). Brackets count outside strings only (``quotes``: the string delimiters);
    whether the value parses is for the parser to say."""

    def __init__(self, start: int, quotes: str = '"'):
        self.i, self.depth, self.quote, self.escaped = start, 0, None, False
        self.quotes = quotes
        self.closed_at: int | None = None

    def end(self, text: str) -> int | None:
        """The index after the closing bracket, or None if ``text`` ends before it."""
        while self.closed_at is None and self.i < len(text):
            ch = text[self.i]
            self.i += 1
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in self.quotes:
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth <= 0:
                    self.closed_at = self.i
        return self.closed_at


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base of the stateful parsers: ``self.text`` is everything fed so far, ``self.pos`` how
    much of it is decided. Subclasses implement ``_step(final)``."""

    def __init__(self):
        self.text = ""
        self.pos = 0

    def feed(self, text: str) -> list[Item]:
        self.text += text
        return self._safe_step(final=False)

    def finish(self) -> list[Item]:
        return self._safe_step(final=True)

    def _safe_step(self, final: bool) -> list[Item]:
        try:
            return self._step(final)
        except Exception:  # a parser bug must not lose the model's text: the rest is content
            rest, self.pos = self.text[self.pos :], len(self.text)
            return [rest] if rest else []

    def _step(self, final: bool) -> list[Item]:
        raise NotImplementedError

    def _flush_content(self, items: list[Item]) -> None:
        """In content mode (subclasses keep a ``mode``), everything not yet decided is content."""
        if self.mode == "content" and self.pos < len(self.text):
            items.append(self.text[self.pos :])
            self.pos = len(self.text)


class CallRunParser(ToolParser):
    """Base of the parsers whose reply is a run of JSON call objects, maybe followed by
    content; a reply with no call in front is content whole."""

    def __init__(self):
        super().__init__()
        self.mode = "start"  # start -> calls -> content
        self.found = 0  # calls found so far
        self.scanner: BracketScanner | None = None  # the object being read

    def _take_call(self, items: list[Item], call: ParsedCall | None, end: int) -> bool:
        """Append ``call`` (the text up to ``end``); None turns the rest to content (False)."""
        if call is None:
            self._to_content()
            return False
        items.append(call)
        self.found += 1
        self.pos, self.scanner = end, None
        return True

    def _to_content(self) -> None:
        """What is left is content; with no call found yet, the reply is content whole."""
        self.mode = "content"
        if not self.found:
            self.pos = 0


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def extract(
    parser: ToolParser, text: str, max_calls: int | None = None
) -> tuple[str | None, list[ParsedCall]]:
    """The whole output ``text`` as (content, calls), at most ``max_calls`` of them. With no
    call the content is the text exactly; with calls, the text around them, trailing whitespace
    dropped, None if empty."""
    items = parser.feed(text) + parser.finish()
    calls = [i for i in items if isinstance(i, ParsedCall)][:max_calls]
    content = "".join(i for i in items if isinstance(i, str))
    if not calls:
        return content, []
    return content.rstrip() or None, calls


def call_json(call: ParsedCall, call_id: str) -> dict:
    """A call as a chat message's ``tool_calls`` entry."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class DeltaStream:
    """One streamed choice: model text in, OpenAI ``delta`` objects out (``{"content": ...}`` or
    ``{"tool_calls": [...]}``). A call goes out as two deltas, its header (index, id, type,
    name, empty arguments) and then its arguments. Whitespace after content is held until more
    content follows, so that the streamed content matches ``extract``'s. At most ``max_calls``
    calls are sent (later ones are dropped, as ``extract`` callers drop them)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.calls: list[ParsedCall] = []
        self.held = ""  # whitespace after the content sent so far

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def push(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[dict]:
        deltas = self._deltas(self.parser.finish())
        if self.held and not self.calls:
            deltas.append({"content": self.held})
        self.held = ""
        return deltas

    def _deltas(self, items: list[Item]) -> list[dict]:
        deltas: list[dict] = []
        for item in items:
            if isinstance(item, ParsedCall):
                if self.max_calls is not None and len(self.calls) >= self.max_calls:
                    continue
                index = len(self.calls)
                self.calls.append(item)
                fn = {"name": item.name, "arguments": ""}
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": new_call_id(),
                                "type": "function",
                                "function": fn,
                            }
                        ]
                    }
                )
                deltas.append(
                    {"tool_calls": [{"index": index, "function": {"arguments": item.arguments}}]}
                )
                continue
            text = self.held + item
            body = text.rstrip()
            self.held = text[len(body) :]
            if body:
                deltas.append({"content": body})
        return deltas
