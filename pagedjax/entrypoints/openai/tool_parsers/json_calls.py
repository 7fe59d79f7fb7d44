"""The calls a grammar-constrained reply carries (tool_choice "required" or a named function):
the named function's arguments object alone, or a JSON array of ``{"name": ..., "arguments":
{...}}``. The grammar makes them valid; a reply cut short (max_tokens) is content."""

from __future__ import annotations

from pagedjax.entrypoints.openai.tool_parsers.base import (
    BracketScanner,
    CallRunParser,
    Item,
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
            elif head or final:
                self.mode = "content"
        if self.mode == "call":
            end = self.scanner.end(self.text)
            if end is None and not final:
                return []
            call = call_of(self.name, loads(self.text[:end])) if end is not None else None
            self.mode = "content"
            if call is not None:
                items.append(call)
                self.pos = end
        self._flush_content(items)
        return items


class ArrayCallsParser(CallRunParser):
    """The reply is a JSON array of calls, each sent as soon as its object closes."""

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
                    self._to_content()
                break
            obj = loads(self.text[at:end])
            call = None
            if isinstance(obj, dict) and set(obj) == {"name", "arguments"}:
                call = call_of(obj["name"], obj["arguments"])
            if not self._take_call(items, call, end):
                break
        self._flush_content(items)
        return items
