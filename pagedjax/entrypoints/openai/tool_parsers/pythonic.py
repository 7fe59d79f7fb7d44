"""Pythonic calls, as Llama 3.2 / Llama 4 and ToolACE-style templates ask for: a Python list of
calls with keyword arguments whose values are literals, optionally between ``<|python_start|>``
and ``<|python_end|>`` (Llama 4), e.g.

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

A reply that does not start with such a list is content, whole; text after the list is content.
JSON's ``true``, ``false`` and ``null`` are taken for Python's constants.
"""

from __future__ import annotations

import ast
import json

from pagedjax.entrypoints.openai.tool_parsers.base import (
    BracketScanner,
    Item,
    ParsedCall,
    ToolParser,
)

START, END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _value(node: ast.AST):
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        keys = [_value(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key is not a string")
        return dict(zip(keys, [_value(v) for v in node.values], strict=True))
    value = ast.literal_eval(node)
    if value is not None and not isinstance(value, str | int | float | bool):
        raise ValueError(f"not a JSON value: {value!r}")
    return value


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def parse_calls(source: str) -> list[ParsedCall] | None:
    """The calls of a Python list of calls, or None if ``source`` is anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            if any(k.arg is None for k in node.keywords):
                return None
            args = {k.arg: _value(k.value) for k in node.keywords}
            calls.append(ParsedCall(_name(node.func), json.dumps(args, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicParser(ToolParser):
    def __init__(self):
        super().__init__()
        self.mode = "start"  # start -> content (after the list, if it was calls)
        self.scanner: BracketScanner | None = None  # the list being read

    def _step(self, final: bool) -> list[Item]:
        items: list[Item] = []
        if self.mode == "start":
            head = self.text.lstrip()
            at = len(self.text) - len(head)
            if head.startswith(START):
                at += len(START)
                head = head[len(START) :].lstrip()
                at = len(self.text) - len(head)
            if not head and not final or (START.startswith(head) and head and not final):
                return []
            end = None
            if head.startswith("["):
                self.scanner = self.scanner or BracketScanner(at, quotes="'\"")
                end = self.scanner.end(self.text)
            if head.startswith("[") and end is None and not final:
                return []
            calls = parse_calls(self.text[at:end]) if end is not None else None
            self.mode = "content"
            if calls:
                items.extend(calls)
                self.pos = end
                rest = self.text[end:].lstrip()
                if rest.startswith(END):
                    self.pos = len(self.text) - len(rest) + len(END)
                elif END.startswith(rest) and not final:
                    self.mode = "end"
                    return items
        if self.mode == "end":
            rest = self.text[self.pos :].lstrip()
            if END.startswith(rest) and rest != END and not final:
                return items
            if rest.startswith(END):
                self.pos = len(self.text) - len(rest) + len(END)
            self.mode = "content"
        if self.pos < len(self.text):
            items.append(self.text[self.pos :])
            self.pos = len(self.text)
        return items
