"""The JSON schemas that force a tool call, built from tools as clients write them.

- A named choice decodes the function's ``parameters``; "required" decodes a JSON array of
  ``{"name": ..., "arguments": ...}`` whose items nest each tool's parameters. A nested schema's
  ``$ref``s still point at its own root, so its ``$defs`` (and the older ``definitions``) move to
  the root of the array's schema, where those references resolve (vLLM does the same); two
  tools that define one name differently are refused naming it, and any other reference into a
  tool's own schema is rewritten to where that schema now sits.
- Objects are held to the properties they name unless the schema says otherwise
  (``additionalProperties`` or ``unevaluatedProperties`` given), as vLLM's default grammar
  backend does: an object schema with ``properties`` or ``patternProperties`` and neither gets
  ``additionalProperties: false``. Members of an ``allOf`` are left open, since closing each
  would refuse the properties its siblings name.

Every walk is iterative (no recursion, whatever the nesting) and copies: the request's own
schemas are never changed.
"""

from __future__ import annotations

from typing import Any

from pagedjax.entrypoints.openai.protocol import bad_request

_DEFS = ("$defs", "definitions")
_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_SCHEMA_MAPS |= {"dependentSchemas"}
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_ONE = frozenset({"additionalProperties", "items", "not", "if", "then", "else"})
_SCHEMA_ONE |= {"contains", "unevaluatedProperties", "unevaluatedItems", "propertyNames"}


def named_call_schema(parameters: dict) -> dict:
    """The schema of a named choice's reply: the function's parameters, objects closed."""
    return close_objects(parameters)


def required_calls_schema(functions: list[dict], max_calls: int | None) -> dict:
    """The schema of a "required" reply: an array of 1 to ``max_calls`` calls of the given
    functions (their ``name`` and ``parameters``), every tool's definitions at its root."""
    defs: dict[str, Any] = {}
    owner: dict[str, int] = {}
    items = []
    for i, fn in enumerate(functions):
        where = f"#/items/anyOf/{i}/properties/arguments"
        params = _map_schemas(fn["parameters"], lambda d, _, where=where: _rehome_refs(d, where))
        for key in _DEFS:
            for name, schema in (params.pop(key, None) or {}).items():
                if name in defs and defs[name] != schema:
                    raise bad_request(
                        f"tools.{i}.function.parameters: the definition {name!r} differs from "
                        f'the one tools.{owner[name]} gives it; tool_choice "required" puts '
                        "every tool's definitions in one schema, so a name must mean one thing",
                        f"tools.{i}.function.parameters",
                    )
                defs[name], owner[name] = schema, owner.get(name, i)
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return close_objects(schema)


def _rehome_refs(node: dict, where: str) -> dict:
    """A schema node of one tool whose local ``$ref`` reads the same once the tool sits at
    ``where``: definitions at the new root's ``$defs``, anything else under ``where``."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#"):
        return node
    for key in _DEFS:
        if ref.startswith(f"#/{key}/"):
            return {**node, "$ref": "#/$defs/" + ref[len(f"#/{key}/") :]}
    return {**node, "$ref": where + ref[1:]}


def close_objects(schema: dict) -> dict:
    """A copy of ``schema`` whose object schemas that name properties and say nothing of
    others get ``additionalProperties: false`` (``allOf`` members excepted)."""
    return _map_schemas(schema, _close)


def _close(node: dict, in_all_of: bool) -> dict:
    names_properties = "properties" in node or "patternProperties" in node
    says = "additionalProperties" in node or "unevaluatedProperties" in node
    if names_properties and not says and not in_all_of:
        return {**node, "additionalProperties": False}
    return node


def _map_schemas(schema: Any, fn) -> Any:
    """A copy of ``schema`` with ``fn(node, in_all_of)`` applied to every schema node
    (``in_all_of``: it is a member of an ``allOf``), parents before children; iterative."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any, bool]] = [(schema, root, 0, False)]
    while stack:
        node, parent, key, in_all_of = stack.pop()
        if not isinstance(node, dict):
            parent[key] = node  # a boolean schema, or a value where a schema was expected
            continue
        node = fn(node, in_all_of)
        out: dict[str, Any] = {}
        parent[key] = out
        for k, v in node.items():
            if k in _DATA:
                out[k] = v  # data: copied as is (it is never changed in place)
            elif k in _SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {}
                stack += [(s, out[k], name, False) for name, s in v.items()]
            elif k in _SCHEMA_LISTS and isinstance(v, list):
                out[k] = [None] * len(v)
                stack += [(s, out[k], j, k == "allOf") for j, s in enumerate(v)]
            elif k in _SCHEMA_ONE:
                if isinstance(v, list):
                    out[k] = [None] * len(v)
                    stack += [(s, out[k], j, False) for j, s in enumerate(v)]
                else:
                    stack.append((v, out, k, False))
            else:
                out[k] = v
    return root[0]
