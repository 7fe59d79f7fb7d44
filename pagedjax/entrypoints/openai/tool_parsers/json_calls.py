"""The calls a grammar-constrained reply carries (tool_choice "required" or a named function):
the named function's arguments object alone, or a JSON array of ``{"name": ..., "arguments":
{...}}``. The grammar makes them valid. A forced reply is answered as calls even when it is cut
short (max_tokens), as vLLM answers it: the named function's call with its arguments' text as
far as it got, and in an array, the complete calls then the cut one once its function is
known.
"""

from __future__ import annotations

import re

from pagedjax.entrypoints.openai.tool_parsers.base import (
    BracketScanner,
    CallRunParser,
    Item,
    ParsedCall,
    ToolParser,
    call_of,
    loads,
)


class NamedCallParser(ToolParser):
    """The reply is the arguments of the function called ``name``."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.mode = "start"  # start -> call -> content
        self.scanner: BracketScanner | None = None

    def _step(self, final: bool) -> list[Item]:
        items: list[Item] = []
        if self.mode == "start":
            head = self.text.lstrip()
            if head.startswith("{"):
                self.mode, self.scanner = "call", BracketScanner(len(self.text) - len(head))
            elif final:  # not an object (an empty reply): the call's arguments all the same
                self.mode = "call"
        if self.mode == "call":
            end = self.scanner.end(self.text) if self.scanner is not None else None
            if end is None and not final:
                return []
            end = len(self.text) if end is None else end
            call = call_of(self.name, loads(self.text[:end]))
            items.append(call or ParsedCall(self.name, self.text[:end].strip()))  # cut short
            self.mode, self.pos = "content", end
        self._flush_content(items)
        return items


class ArrayCallsParser(CallRunParser):
    """The reply is a JSON array of calls, each sent as soon as its object closes. ``names``:
    the functions it may call (to tell which one a cut call is)."""

    def __init__(self, names: tuple[str, ...] = ()):
        super().__init__()
        self.names = tuple(names)

    def _step(self, final: bool) -> list[Item]:
        items: list[Item] = []
        if self.mode == "start":
            head = self.text.lstrip()
            if not head and not final:
                return []
            self.mode = "calls" if head.startswith("[") else "content"
            self.pos = len(self.text) - len(head) + 1 if self.mode == "calls" else 0
        while self.mode == "calls":
            at = self.pos
            while at < len(self.text) and self.text[at] in " \t\r\n,":
                at += 1
            if at == len(self.text):
                if final:
                    self._to_content()
                break
            if self.text[at] == "]" and self.found:
                self.mode, self.pos = "content", at + 1
                break
            if self.text[at] != "{":
                self._to_content()
                break
            if self.scanner is None:
                self.scanner = BracketScanner(at)
            end = self.scanner.end(self.text)
            if end is None:
                if final:
                    self._take_cut_call(items, self.text[at:])
                break
            obj = loads(self.text[at:end])
            call = None
            if isinstance(obj, dict) and set(obj) == {"name", "arguments"}:
                call = call_of(obj["name"], obj["arguments"])
            if not self._take_call(items, call, end):
                break
        self._flush_content(items)
        return items

    def _take_cut_call(self, items: list[Item], text: str) -> None:
        """The call a reply cut short inside its last object had begun (``cut_call``), its
        arguments as far as they got; the rest is content if it names no function."""
        call = cut_call(text, self.names)
        if call is None:
            self._to_content()
            return
        items.append(call)
        self.found += 1
        self.mode, self.pos, self.scanner = "content", len(self.text), None


_FIELD = re.compile(r'\s*,?\s*"(name|arguments)"\s*:\s*')
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)("?)')


def cut_call(text: str, names: tuple[str, ...]) -> ParsedCall | None:
    """The call in ``text``, an object ``{"name": ..., "arguments": ...}`` cut short (its keys
    in either order: the grammar does not order them), its arguments as far as they got. The
    function is its name; else the one of ``names`` that what there is of the name (maybe
    nothing) begins; None if that is not one function."""
    name, prefix, arguments, at = None, "", "", 1
    while (field := _FIELD.match(text, at)) is not None:
        at = field.end()
        if field[1] == "arguments":
            end = BracketScanner(at).end(text)
            arguments = text[at:end].strip()
            if end is None:
                break
            at = end
            continue
        value = _STRING.match(text, at)
        decoded = loads(f'"{value[1]}"') if value is not None else None
        if not isinstance(decoded, str):
            break
        if not value[2]:  # cut inside the name
            prefix = decoded
            break
        name, at = decoded, value.end()
    if name is None:
        fits = [n for n in names if n.startswith(prefix)]
        name = fits[0] if len(fits) == 1 else None
    return ParsedCall(name, arguments) if name else None
