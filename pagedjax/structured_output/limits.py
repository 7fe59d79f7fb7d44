"""Bounds a structured-output constraint must stay within before llguidance sees it.

llguidance builds grammars by recursion: a long ``$ref`` or rule chain overflows a thread's stack
and takes the whole process down (SIGSEGV), and a nested counted repetition (``(a{1000}){1000}``)
exhausts its lexer after one token. These checks are pure Python, iterative (no recursion, so no
RecursionError), linear in the size of the constraint, and each refusal is a ``ValueError`` that
names the limit and the value found. Compilation itself then runs in a worker thread with a
large stack and a time budget (structured_worker.py).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_SCHEMA_CHARS = 1_000_000  # a JSON schema as JSON text
MAX_SCHEMA_DEPTH = 100  # nested objects and arrays ($ref hops counted); llguidance parses 128
MAX_GRAMMAR_CHARS = 1_000_000  # a Lark or GBNF grammar, a regex, a choice list (all its strings)
MAX_RULE_CHAIN = 256  # rules on the longest chain of references, cycles cut
MAX_NESTING = 256  # parentheses inside a regex or a grammar
MAX_REGEX_REPEAT = 10_000  # product of the nested counted repetitions ({n}, {m,n}) of a regex
MAX_INTEGER = 2**53  # llguidance keeps integer bounds as 64-bit floats: exact up to 2**53
# One token's grammar work (llguidance's parser limits): a grammar that needs more ends its
# sequence "abort", the limit named, instead of holding every request's step. An ambiguous
# grammar's cost per token grows with the items in an Earley row, about as their cube:
# llguidance's default of 2,000 lets one sequence take 0.3-0.5 s per token, 500 at most about
# 20 ms. Alternatives beyond that belong in one lexeme (``choice``, ``enum``, a regex).
MASK_ROW_ITEMS = 500  # Earley items at one position (llguidance's default: 2,000)
MASK_LEXER_FUEL = 200_000  # lexer work for one mask (its default; about 15 ms)
MASK_MAX_ITEMS = 50_000  # Earley items one mask may create (its default; about 3 ms)

_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def parser_limits():
    """The llguidance limits every matcher and grammar check is built with."""
    import llguidance

    return llguidance.LLParserLimits(
        max_items_in_row=MASK_ROW_ITEMS,
        step_lexer_fuel=MASK_LEXER_FUEL,
        step_max_items=MASK_MAX_ITEMS,
    )


def _refuse(kind: str, limit: str, value: int | str, bound: int) -> ValueError:
    return ValueError(f"structured_outputs.{kind}: {limit} is {value}, over the limit of {bound}")


_JSON_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def check_json_text(text: str, kind: str = "json", name: str = "schema") -> None:
    """A schema given as text: its size and nesting, before json.loads recurses into it."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise _refuse(kind, f"the {name}'s length in characters", len(text), MAX_SCHEMA_CHARS)
    depth = deepest = 0
    for token in _JSON_BRACKETS.finditer(text):
        c = token.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    if deepest > MAX_SCHEMA_DEPTH:
        raise _refuse(kind, f"the {name}'s nesting depth", deepest, MAX_SCHEMA_DEPTH)


def check_schema(schema: Any, kind: str = "json", name: str = "schema") -> None:
    """A JSON schema (a dict or a bool): only JSON values (a ValueError names the path of any
    other, e.g. a set), nesting with $ref hops, integer bounds, string patterns. The size is
    checked by the caller on its canonical text."""
    if isinstance(schema, bool):
        return
    for at, node, in_data in _walk(schema, kind, name):
        if isinstance(node, dict) and not in_data:
            _check_schema_object(kind, at, node)
    height, whole = _height(schema, _local_refs(schema), MAX_SCHEMA_DEPTH)
    if height > MAX_SCHEMA_DEPTH:
        value = height if whole else f"at least {height}"
        raise _refuse(kind, f"the {name}'s depth ($ref hops included)", value, MAX_SCHEMA_DEPTH)


def _path(at) -> str:
    """The text of a place in a schema (``schema['a'][0]``): a place is the schema's name or
    (its parent's place, its key), built as the walk goes and rendered only for a message."""
    keys = []
    while isinstance(at, tuple):
        at, key = at
        keys.append(f"[{key!r}]")
    return at + "".join(reversed(keys))


def _walk(root: Any, kind: str, name: str):
    """(place, node, inside a data value) for every container in root (its place as
    ``_path`` reads it), depth-first, iterative; a value that is not JSON is a ValueError
    naming its path."""
    stack: list[tuple[Any, Any, bool, int]] = [(name, root, False, 1)]
    while stack:
        at, node, in_data, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _refuse(
                kind, f"the {name}'s nesting depth", f"at least {depth}", MAX_SCHEMA_DEPTH
            )
        yield at, node, in_data
        is_dict = isinstance(node, dict)
        for key, value in node.items() if is_dict else enumerate(node):
            if isinstance(value, dict | list | tuple):
                data = in_data or (is_dict and key in _DATA_KEYWORDS)
                stack.append(((at, key), value, data, depth + 1))
            elif not isinstance(value, str | int | bool | type(None)) and not (
                isinstance(value, float) and math.isfinite(value)
            ):
                where = _path((at, key))
                if isinstance(value, float):
                    raise ValueError(
                        f"structured_outputs.{kind}: {where} is {value}, not a JSON number"
                    )
                raise ValueError(
                    f"structured_outputs.{kind}: {where} is a {type(value).__name__}, not a JSON "
                    "value (use a list)"
                )
            if is_dict and not isinstance(key, str):
                raise ValueError(
                    f"structured_outputs.{kind}: {_path(at)} has the key {key!r}; JSON keys are "
                    "strings"
                )


def _check_schema_object(kind: str, at, node: dict) -> None:
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types or types == [None]:
        for name in _BOUNDS:
            v = node.get(name)
            if isinstance(v, int | float) and not isinstance(v, bool) and abs(v) > MAX_INTEGER:
                raise ValueError(
                    f"structured_outputs.{kind}: {_path(at)}[{name!r}] is {v}, beyond the range of "
                    f"integer bounds kept exactly, [-2**53, 2**53] = [{-MAX_INTEGER}, "
                    f"{MAX_INTEGER}] (bounds are 64-bit floats)"
                )
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, kind, f"the pattern at {_path(at)}")


def _local_refs(schema: Any):
    """A function from a "$ref" value to the container it points at in schema (or None)."""

    def resolve(ref: Any):
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = schema
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if isinstance(node, dict | list) else None

    return resolve


def _height(root: Any, resolve, limit: int) -> tuple[int, bool]:
    """Containers on the longest path down from root, a local $ref counted as a hop into its
    target; a path that comes back to a container on it (a recursive schema) stops there.
    (height, True), or (n, False) once a path of n > ``limit`` containers is found (the walk
    stops there: the height is at least n)."""
    memo: dict[int, int] = {}
    on_path: set[int] = {id(root)}
    stack = [(root, _kids(root, resolve), 0)]
    while stack:
        if len(stack) > limit:
            return len(stack), False
        node, kids, i = stack[-1]
        if i == len(kids):
            stack.pop()
            on_path.discard(id(node))
            memo[id(node)] = 1 + max((memo.get(id(k), 0) for k in kids), default=0)
            continue
        stack[-1] = (node, kids, i + 1)
        kid = kids[i]
        if id(kid) not in memo and id(kid) not in on_path:
            on_path.add(id(kid))
            stack.append((kid, _kids(kid, resolve), 0))
    return memo[id(root)], True


def _kids(node: Any, resolve) -> list:
    values = node.values() if isinstance(node, dict) else node
    kids = [v for v in values if isinstance(v, dict | list | tuple)]
    if isinstance(node, dict) and "$ref" in node:
        target = resolve(node["$ref"])
        if target is not None:
            kids.append(target)
    return kids


def check_regex(regex: str, kind: str = "regex", what: str = "the regex") -> None:
    """Size, group nesting and the product of nested counted repetitions of a regex (Rust's
    syntax): ``(a{1000}){1000}`` is 1,000,000, more than llguidance's lexer can build."""
    if len(regex) > MAX_GRAMMAR_CHARS:
        raise _refuse(kind, f"{what}'s length in characters", len(regex), MAX_GRAMMAR_CHARS)
    frames = [[0, None]]  # per open group: [largest finished item, last item] (repeat products)
    for token in re.finditer(
        r"\\[pPxu]\{[^}]*\}|\\.|\[(?:\\.|\[[^\]]*\]|[^\]\\])+\]|\{(\d+)(?:,(\d*))?\}|[()|]|.",
        regex,
        re.DOTALL,
    ):
        c, frame = token.group(), frames[-1]
        if c == "(":
            frames.append([0, None])
            if len(frames) > MAX_NESTING:
                raise _refuse(kind, f"{what}'s group nesting", len(frames), MAX_NESTING)
        elif c == ")" and len(frames) > 1:
            inner = frames.pop()
            frame = frames[-1]
            frame[0], frame[1] = max(frame[0], frame[1] or 0), max(inner[0], inner[1] or 0, 1)
        elif c == "|":
            frame[0], frame[1] = max(frame[0], frame[1] or 0), None
        elif token.group(1) is not None:  # {m}, {m,} or {m,n}
            if frame[1] is not None:
                low, high = int(token.group(1)), token.group(2)
                frame[1] *= max(low, int(high) if high else 0, 1)
                if frame[1] > MAX_REGEX_REPEAT:  # only grows: the product so far is enough
                    raise _refuse(
                        kind, f"{what}'s nested repetition count", frame[1], MAX_REGEX_REPEAT
                    )
        elif c not in "*+?":
            frame[0], frame[1] = max(frame[0], frame[1] or 0), 1


_LARK_TOKENS = re.compile(
    r'"(?:[^"\\\n]|\\.)*"i?'  # a string literal
    r"|/(?![/*])((?:[^/\\\n]|\\.)+)/[imslux]*"  # a regex (group 1)
    r"|//[^\n]*"  # a comment
    r"|([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*(:)?"  # a name; a definition if (3)
    r"|[()]"
)
_GBNF_TOKENS = re.compile(
    r'"(?:[^"\\\n]|\\.)*"'  # a string literal
    r"|(\[(?:[^\]\\\n]|\\.)*\])"  # a character class (group 1, not a regex to check)
    r"|#[^\n]*"  # a comment
    r"|([A-Za-z_][A-Za-z0-9_\-]*)\s*(::=)?"  # a name; a definition if (3)
    r"|[()]"
)


def check_grammar(text: str) -> None:
    """A Lark or GBNF grammar: size, parenthesis nesting, its regexes, and the longest chain of
    rule references (each rule's body names the rules it goes through)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _refuse("grammar", "the grammar's length", len(text), MAX_GRAMMAR_CHARS)
    gbnf = "::=" in text
    tokens = _GBNF_TOKENS if gbnf else _LARK_TOKENS
    rules: dict[str, list[str]] = {}
    body: list[str] = []
    depth = 0
    for token in tokens.finditer(text):
        c = token.group()
        if token.group(1) is not None and not gbnf:
            check_regex(token.group(1), "grammar", f"the regex /{token.group(1)[:40]}/")
        elif token.group(2) is not None:
            if token.group(3) is not None:
                body = rules.setdefault(token.group(2), [])
            else:
                body.append(token.group(2))
        elif c in "()":
            depth += 1 if c == "(" else -1
            if depth > MAX_NESTING:
                raise _refuse("grammar", "the grammar's parenthesis nesting", depth, MAX_NESTING)
    _check_embedded_schemas(text)
    chain, whole = _longest_chain(rules, MAX_RULE_CHAIN)
    if chain > MAX_RULE_CHAIN:
        value = chain if whole else f"at least {chain}"
        raise _refuse("grammar", "the longest chain of rule references", value, MAX_RULE_CHAIN)


def _check_embedded_schemas(text: str) -> None:
    """The JSON schemas a Lark grammar embeds (llguidance's ``%json { ... }``)."""
    for m in re.finditer(r"%json\s*(?=\{)", text):
        name = f"%json schema at character {m.end()}"
        end = _json_end(text, m.end())
        check_json_text(text[m.end() : end], "grammar", name)
        try:
            schema = json.loads(text[m.end() : end])
        except (ValueError, RecursionError) as e:
            raise ValueError(f"structured_outputs.grammar: the {name} is not JSON: {e}") from None
        check_schema(schema, "grammar", name)


def _json_end(text: str, start: int) -> int:
    """Where the JSON object starting at text[start] ends (its braces balanced, strings
    skipped); the text's end if it does not."""
    depth = 0
    for token in _JSON_BRACKETS.finditer(text, start):
        depth += 1 if token.group() in "[{" else -1 if token.group() in "]}" else 0
        if depth == 0:
            return token.end()
    return len(text)


def _longest_chain(rules: dict[str, list[str]], limit: int) -> tuple[int, bool]:
    """Rules on the longest path of references; a reference back onto the path is cut.
    (length, True), or (n, False) once a path of n > ``limit`` rules is found (the search stops
    there: the longest is at least n)."""
    memo: dict[str, int] = {}
    for start in rules:
        if start in memo:
            continue
        on_path, stack = {start}, [(start, iter(rules[start]))]
        while stack:
            if len(stack) > limit:
                return len(stack), False
            name, refs = stack[-1]
            ref = next(refs, None)
            if ref is None:
                stack.pop()
                on_path.discard(name)
                memo[name] = 1 + max((memo.get(r, 0) for r in rules[name] if r in rules), default=0)
            elif ref in rules and ref not in memo and ref not in on_path:
                on_path.add(ref)
                stack.append((ref, iter(rules[ref])))
    return max(memo.values(), default=0), True


def check_choice(choices: list[str]) -> None:
    total = sum(len(c) for c in choices)
    if total > MAX_GRAMMAR_CHARS:
        raise _refuse("choice", "the choices' total length", total, MAX_GRAMMAR_CHARS)
