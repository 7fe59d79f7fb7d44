"""Llama 3.1 / 3.2 JSON calls: the whole reply is a call object, ``{"name": ..., "parameters":
{...}}`` (``"arguments"`` is taken too), as the Llama 3 chat template asks for, optionally after
``<|python_tag|>``; several calls are separated by ``;`` or whitespace, e.g.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that does not start with a call object is content, whole. After one or more calls,
whatever does not parse as a further call is content from there on.
"""

from __future__ import annotations

from pagedjax.entrypoints.openai.tool_parsers.base import (
    BracketScanner,
    CallRunParser,
    Item,
    ParsedCall,
    call_of,
    loads,
)

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


def json_call(text: str) -> ParsedCall | None:
    obj = loads(text)
    if not isinstance(obj, dict) or "name" not in obj:
        return None
    keys = set(obj) - {"name"}
    if len(keys) != 1 or not keys <= {"parameters", "arguments"}:
        return None
    return call_of(obj["name"], obj[keys.pop()])


class Llama3JsonParser(CallRunParser):
    def __init__(self):
        super().__init__()
        self.scanner_at = -1  # where the object being read starts

    def _step(self, final: bool) -> list[Item]:
        if self.mode == "start" and not self._start(final):
            return []
        items: list[Item] = []
        while self.mode == "calls":
            at = self.pos
            while at < len(self.text) and self.text[at] in _SEPARATORS:
                at += 1
            if at == len(self.text):
                if final:
                    self._to_content()
                break
            end = None
            if self.text[at] == "{":
                if self.scanner is None or self.scanner_at != at:
                    self.scanner, self.scanner_at = BracketScanner(at), at
                end = self.scanner.end(self.text)
                if end is None and not final:
                    break  # the object is still coming
            call = json_call(self.text[at:end]) if end is not None else None
            if not self._take_call(items, call, end):
                break
        self._flush_content(items)
        return items

    def _start(self, final: bool) -> bool:
        """Decide whether the reply is calls; False while it cannot be told yet."""
        head = self.text.lstrip()
        if head.startswith(PYTHON_TAG):
            self.mode = "calls"
            self.pos = len(self.text) - len(head) + len(PYTHON_TAG)
        elif head.startswith("{"):
            self.mode = "calls"
        elif (not head or PYTHON_TAG.startswith(head)) and not final:
            return False
        else:
            self.mode = "content"
        return True

    def _to_content(self) -> None:
        """As the base, and separators alone after the calls are no content."""
        super()._to_content()
        if self.found and self.text[self.pos :].strip(_SEPARATORS) == "":
            self.pos = len(self.text)  # only separators after the calls
