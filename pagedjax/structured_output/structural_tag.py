"""Structural tags (vLLM's ``response_format: {"type": "structural_tag", ...}``): free text in
which a trigger (``"<function="``) starts a tag whose content is constrained, as a tool call in
running text. Both of vLLM's spellings, translated to llguidance's Lark:

- the older form, ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``: any text,
  and every tag that starts with a trigger holds JSON of its schema (as vLLM's guidance backend
  writes it with llguidance's StructTag: each trigger a lazy lexeme ending the text before it);
- the newer one, ``{"format": {...}}`` (xgrammar's structural tag): formats ``const_string``,
  ``json_schema``, ``regex``, ``grammar``, ``any_text``, ``sequence``, ``or``, ``tag``,
  ``triggered_tags``, ``tags_with_separator``, ``optional``, ``star``, ``plus`` and ``repeat``.
  Token formats (``token``, ``exclude_token``, ``any_tokens``, ``token_triggered_tags``,
  ``dispatch``) and XML styles of ``json_schema`` are refused, naming them.

JSON inside tags is generated in the style of every other JSON here (params.JSON_STYLE). Every
schema, regex and grammar inside is held to the limits of its kind (limits.py), and a tag spec to
MAX_FORMATS formats. ValueErrors name the place in the spec (``structural_tag.format.tags.0``).
Host side, pure Python; no jax.
"""

from __future__ import annotations

import json
from typing import Any

from pagedjax.structured_output import limits
from pagedjax.structured_output.lark import grammar_lark

MAX_FORMATS = 512  # formats (nodes) in one structural tag
_TEXT = r"(.|\n)*"
_UNSUPPORTED = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "dispatch")
FORMATS = ("const_string", "json_schema", "regex", "grammar", "any_text", "sequence", "or", "tag")
FORMATS += ("triggered_tags", "tags_with_separator", "optional", "star", "plus", "repeat")


def normalize(spec: Any, style: dict) -> dict:
    """The spec as a dict (JSON text parsed), its form checked: ``structures`` and
    ``triggers``, or ``format``; ``style``: the JSON style of its schemas (grammar_text).
    ValueError naming what is wrong."""
    if isinstance(spec, str):
        limits.check_json_text(spec)
        try:
            spec = json.loads(spec)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be a JSON object")
    kind = spec.get("type", "structural_tag")
    if kind != "structural_tag":
        raise ValueError(f"structural_tag: type must be 'structural_tag', got {kind!r}")
    if "format" in spec:
        extra = sorted(set(spec) - {"type", "format"})
    elif "structures" in spec:
        extra = sorted(set(spec) - {"type", "structures", "triggers"})
    else:
        raise ValueError("structural_tag needs 'format', or 'structures' and 'triggers'")
    if extra:
        raise ValueError(f"structural_tag: unknown field {extra[0]!r}")
    grammar_text(spec, style)  # every part checked now, before it is compiled
    return spec


def grammar_text(spec: dict, style: dict) -> str:
    """llguidance's grammar for a normalized spec: Lark, or a grammar list (JSON) when a
    ``grammar`` format brings a grammar of its own; its JSON in llguidance's ``style``."""
    builder = _Builder(style)
    if "format" in spec:
        start = builder.format(spec["format"], "structural_tag.format")
    else:
        start = builder.legacy(spec.get("structures"), spec.get("triggers"))
    return builder.render(start)


def _literal(text: str) -> str:
    return json.dumps(text)


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _text_terminal(excludes: list[str]) -> str:
    """Any text (without the ``excludes`` strings in it)."""
    if not excludes:
        return _regex(_TEXT)
    words = "|".join(_escape_regex(w) for w in excludes)
    return f"{_regex(_TEXT)} & ~{_regex(f'{_TEXT}({words}){_TEXT}')}"


def _escape_regex(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)


class _Builder:
    """Rules of one grammar, named r0, r1, ... (T0, ... for terminals)."""

    def __init__(self, style: dict):
        self.style = style
        self.rules: list[str] = []
        self.side: list[dict] = []  # sub-grammars: {"name", "lark_grammar"}
        self.count = 0

    def name(self, prefix: str = "r") -> str:
        self.count += 1
        if self.count > MAX_FORMATS:
            raise ValueError(f"structural_tag: more than {MAX_FORMATS} formats")
        return f"{prefix}{self.count}"

    def rule(self, body: str, attrs: str = "") -> str:
        name = self.name()
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def terminal(self, body: str) -> str:
        name = self.name("T")
        self.rules.append(f"{name}: {body}")
        return name

    def render(self, start: str) -> str:
        lark = "%llguidance {}\nstart: " + start + "\n" + "\n".join(self.rules) + "\n"
        if not self.side:
            return lark
        return json.dumps(
            {"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *self.side]}
        )

    # ---- the older form: structures and triggers ------------------------------------------------

    def legacy(self, structures, triggers) -> str:
        where = "structural_tag"
        if not isinstance(triggers, list) or not triggers:
            raise ValueError(f"{where}.triggers must be a non-empty list of strings")
        if not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{where}.triggers must be a non-empty list of strings")
        if not isinstance(structures, list) or not structures:
            raise ValueError(f"{where}.structures must be a non-empty list")
        tags = []
        for i, s in enumerate(structures):
            loc = f"{where}.structures.{i}"
            if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
                raise ValueError(f"{loc} must be an object with 'begin', 'schema' and 'end'")
            extra = sorted(set(s) - {"begin", "schema", "end"})
            if extra:
                raise ValueError(f"{loc}: unknown field {extra[0]!r}")
            content = {"type": "json_schema", "json_schema": s["schema"]}
            tags.append({"type": "tag", "begin": s["begin"], "content": content, "end": s["end"]})
        return self.triggered({"triggers": triggers, "tags": tags}, where, "structures")

    # ---- the newer form: xgrammar's formats -----------------------------------------------------

    def format(self, node, where: str) -> str:
        """An expression matching ``node``."""
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise ValueError(f"{where} must be an object with a string 'type'")
        kind = node["type"]
        if kind in _UNSUPPORTED:
            raise ValueError(f"{where}: the {kind!r} format is not supported by this server")
        if kind not in FORMATS:
            raise ValueError(f"{where}: unknown format type {kind!r}; known: {', '.join(FORMATS)}")
        return getattr(self, "_" + kind)(node, where)

    def _field(self, node, where, name, kind, default=None):
        value = node.get(name, default)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise ValueError(f"{where}.{name} must be of type {kind.__name__}, got {value!r}")
        return value

    def _const_string(self, node, where) -> str:
        return _literal(self._field(node, where, "value", str))

    def _json_schema(self, node, where) -> str:
        schema = node.get("json_schema")
        style = node.get("style", "json")
        if style != "json":
            raise ValueError(f"{where}.style {style!r} is not supported (only 'json')")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.json_schema must be a JSON schema (an object or true)")
        limits.check_schema(schema)
        return "%json " + json.dumps({**schema, "x-guidance": self.style})

    def _regex(self, node, where) -> str:
        pattern = self._field(node, where, "pattern", str)
        limits.check_regex(pattern)
        return self.terminal(_regex(pattern))

    def _grammar(self, node, where) -> str:
        text = self._field(node, where, "grammar", str)
        limits.check_grammar(text)
        try:
            lark = grammar_lark(text)
        except ValueError as e:
            raise ValueError(f"{where}.grammar: {e}") from None
        name = f"g{len(self.side) + 1}"
        self.side.append({"name": name, "lark_grammar": lark})
        return "@" + name

    def _any_text(self, node, where) -> str:
        return self.terminal(_text_terminal(self._strings(node, where, "excludes", [])))

    def _strings(self, node, where, name, default=None) -> list[str]:
        value = self._field(node, where, name, list, default)
        if not all(isinstance(x, str) and x for x in value):
            raise ValueError(f"{where}.{name} must be a list of non-empty strings")
        return value

    def _elements(self, node, where) -> list:
        elements = self._field(node, where, "elements", list)
        if not elements:
            raise ValueError(f"{where}.elements must not be empty")
        return elements

    def _sequence(self, node, where) -> str:
        elements, parts = self._elements(node, where), []
        i = 0
        while i < len(elements):
            loc = f"{where}.elements.{i}"
            element = elements[i]
            follows = elements[i + 1] if i + 1 < len(elements) else None
            if _is(element, "any_text") and follows is not None:
                if not _is(follows, "const_string"):
                    raise ValueError(
                        f"{loc}: any_text must end the sequence or be followed by a const_string"
                    )
                parts.append(self._text_until(element, self._const_string(follows, loc), loc))
                i += 2
                continue
            parts.append(self.format(element, loc))
            i += 1
        return self.rule(" ".join(parts))

    def _text_until(self, text_node, end: str, where) -> str:
        """Any text up to the first ``end`` (and ``end``): a lazy lexeme."""
        excludes = self._strings(text_node, where, "excludes", [])
        return self.rule(f"{self.terminal(_text_terminal(excludes))} {end}", "[lazy]")

    def _or(self, node, where) -> str:
        parts = [
            self.format(e, f"{where}.elements.{i}")
            for i, e in enumerate(self._elements(node, where))
        ]
        return self.rule(" | ".join(parts))

    def _tag(self, node, where) -> str:
        begin = node.get("begin")
        if not isinstance(begin, str):
            raise ValueError(f"{where}.begin must be a string (token begins are not supported)")
        return self.rule(f"{_literal(begin) if begin else ''} {self._tag_rest(node, where)}")

    def _tag_rest(self, node, where) -> str:
        """The content and end of a tag."""
        end = node.get("end")
        ends = [end] if isinstance(end, str) else end
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            raise ValueError(f"{where}.end must be a string or a non-empty list of strings")
        end_expr = "(" + " | ".join(_literal(e) for e in ends) + ")"
        content = node.get("content")
        if _is(content, "any_text") and all(ends):
            return self._text_until(content, end_expr, f"{where}.content")
        return f"{self.format(content, f'{where}.content')} {end_expr}"

    def _tags(self, node, where) -> list[dict]:
        tags = self._field(node, where, "tags", list)
        if not tags:
            raise ValueError(f"{where}.tags must not be empty")
        for i, tag in enumerate(tags):
            if not _is(tag, "tag") and not (
                isinstance(tag, dict) and "begin" in tag and "type" not in tag
            ):
                raise ValueError(f"{where}.tags.{i} must be a tag format")
        return tags

    def _triggered_tags(self, node, where) -> str:
        return self.triggered(node, where, "tags")

    def triggered(self, node: dict, where: str, tags_field: str) -> str:
        """Any text in which each trigger starts one of its tags (llguidance's lazy trigger
        lexemes, as its StructTag writes them)."""
        triggers = self._strings(node, where, "triggers")
        if not triggers:
            raise ValueError(f"{where}.triggers must not be empty")
        excludes = self._strings(node, where, "excludes", [])
        text = self.terminal(_text_terminal(excludes))
        alternatives = []
        for i, tag in enumerate(self._tags(node, where)):
            loc = f"{where}.{tags_field}.{i}"
            begin = tag.get("begin")
            matching = [t for t in triggers if isinstance(begin, str) and begin.startswith(t)]
            if len(matching) != 1:
                raise ValueError(
                    f"{loc}.begin {begin!r} must start with exactly one of the triggers {triggers}"
                )
            trig = self.rule(f"{text} {_literal(matching[0])}", "[lazy]")
            rest = begin[len(matching[0]) :]
            body = f"{trig} {_literal(rest) if rest else ''} {self._tag_rest(tag, loc)}"
            alternatives.append(self.rule(body))
        one = self.rule(" | ".join(alternatives))
        at_least_one = self._field(node, where, "at_least_one", bool, False)
        if self._field(node, where, "stop_after_first", bool, False):
            return one if at_least_one else f"({one} | {text})"
        return f"{one}{'+' if at_least_one else '*'} {text}"

    def _tags_with_separator(self, node, where) -> str:
        tags = [self._tag(t, f"{where}.tags.{i}") for i, t in enumerate(self._tags(node, where))]
        one = self.rule(" | ".join(tags))
        sep = _literal(self._field(node, where, "separator", str))
        at_least_one = self._field(node, where, "at_least_one", bool, False)
        if self._field(node, where, "stop_after_first", bool, False):
            body = one
        else:
            body = self.rule(f"{one} ({sep} {one})*")
        return body if at_least_one else f"({body})?"

    def _optional(self, node, where) -> str:
        return f"({self.format(node.get('content'), where + '.content')})?"

    def _star(self, node, where) -> str:
        return f"({self.format(node.get('content'), where + '.content')})*"

    def _plus(self, node, where) -> str:
        return f"({self.format(node.get('content'), where + '.content')})+"

    def _repeat(self, node, where) -> str:
        low = self._field(node, where, "min", int)
        high = self._field(node, where, "max", int)
        if low < 0 or (high != -1 and high < low):
            raise ValueError(f"{where}: min and max must satisfy 0 <= min <= max (or max -1)")
        inner = self.rule(self.format(node.get("content"), where + ".content"))
        if high == -1:
            return f"{inner} ~ {low} {inner}*" if low else f"{inner}*"
        return f"{inner} ~ {low}..{high}"


def _is(node, kind: str) -> bool:
    return isinstance(node, dict) and node.get("type") == kind
