"""Hermes-style calls, as Qwen 2.5 / Qwen 3 (and NousResearch Hermes) chat templates ask for:
each call is a JSON object on its own between ``<tool_call>`` and ``</tool_call>``, e.g.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A block whose JSON is not a call stays in the content as
written, tags included; a block the output cuts short is content too.
"""

from __future__ import annotations

from pagedjax.entrypoints.openai.tool_parsers.base import (
    Item,
    ToolParser,
    call_of,
    loads,
    partial_marker,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    def _step(self, final: bool) -> list[Item]:
        items: list[Item] = []
        while self.pos < len(self.text):
            start = self.text.find(OPEN, self.pos)
            if start < 0:
                # the end may be the first characters of a tag: wait for the next piece
                keep = 0 if final else partial_marker(self.text[self.pos :], OPEN)
                end = len(self.text) - keep
                if end > self.pos:
                    items.append(self.text[self.pos : end])
                self.pos = end
                break
            if start > self.pos:
                items.append(self.text[self.pos : start])
                self.pos = start
            close = self.text.find(CLOSE, start + len(OPEN))
            if close < 0:
                if final:  # cut short: content as written
                    items.append(self.text[start:])
                    self.pos = len(self.text)
                break
            end = close + len(CLOSE)
            obj = loads(self.text[start + len(OPEN) : close])
            call = None
            if isinstance(obj, dict) and set(obj) <= {"name", "arguments"}:
                call = call_of(obj.get("name"), obj.get("arguments", {}))
            items.append(call if call is not None else self.text[start:end])
            self.pos = end
        return items
