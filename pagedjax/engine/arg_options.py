"""How one engine option is declared: a dataclass field whose metadata holds its help, its flags
and what pagedjax does with it. ``EngineArgs`` (engine/arg_utils.py) declares every option once
this way; its command-line flags, ``LLM``'s keywords and the engine's configs are read from the
declarations.

An option is one of three kinds:
- it applies (most): its value reaches the engine;
- it is inert (``inert=why``): vLLM's option with no meaning here (CUDA graphs, remote code);
  accepted, and a value other than the default is logged once with the reason;
- it is checked (``check=f``): ``f(value)`` raises ValueError for the values pagedjax lacks
  (``--pipeline-parallel-size 2``), naming the option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("pagedjax.engine.arg_utils")


def option(
    default: Any,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    choices: tuple | None = None,
    metavar: str | None = None,
    group: str = "engine",
    inert: str | None = None,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """A field of EngineArgs: its default and how it is offered and handled (module docstring).
    ``flags``: more spellings of its flag (``-tp``). A flag's value is parsed by the field's
    type (a dict as a JSON object)."""
    meta = dict(
        help=help,
        flags=flags,
        choices=choices,
        metavar=metavar,
        group=group,
        inert=inert,
        check=check,
    )
    return dataclasses.field(default=default, metadata=meta)


def flag_of(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def add_fields(container, cls, groups: dict[str, str]) -> None:
    """Add a flag for every field of ``cls`` to ``container`` (a parser, or an argument group:
    vLLM's examples pass either), under one argument group per ``groups`` entry when it is a
    parser."""
    targets: dict[str, Any] = {}
    order = list(groups)
    for field in sorted(dataclasses.fields(cls), key=lambda f: order.index(f.metadata["group"])):
        group = field.metadata["group"]
        if group not in targets:
            nested = isinstance(container, argparse.ArgumentParser) and group in groups
            targets[group] = container.add_argument_group(groups[group]) if nested else container
        _add_flag(targets[group], field)


def _add_flag(target, field: dataclasses.Field) -> None:
    meta = field.metadata
    help_ = meta["help"]
    if meta["inert"]:
        help_ += f" [accepted for vLLM; no effect here: {meta['inert']}]"
    elif field.default is not None and field.default is not False and "default" not in help_:
        help_ += " (default: %(default)s)"
    kwargs: dict[str, Any] = dict(default=field.default, help=help_, dest=field.name)
    if _kind(field) is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = _argparse_type(field)
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kwargs["metavar"] = meta["metavar"]
    target.add_argument(flag_of(field), *meta["flags"], **kwargs)


def _kind(field: dataclasses.Field) -> type:
    """The value's type, read from the annotation's text (``int | None`` is int)."""
    text = str(field.type)
    for name, kind in (("bool", bool), ("dict", dict), ("float", float), ("int", int)):
        if text.split(" | ")[0] == name:
            return kind
    return str


def _argparse_type(field: dataclasses.Field) -> Callable[[str], Any]:
    """What turns the flag's text into the field's value; a ValueError from the field's check
    (or the parse) becomes argparse's usage error, naming the flag, before anything loads."""
    meta = field.metadata
    parse = {dict: json_object, float: float, int: int}.get(_kind(field), str)
    check = meta["check"]

    def typed(text: str):
        try:
            value = parse(text)
            if check is not None:
                check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    typed.__name__ = getattr(parse, "__name__", "value")  # argparse names it in errors
    return typed


def json_object(text: str) -> dict:
    """A JSON object (an argparse type)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    return value


def check_fields(args) -> None:
    """Run every field's check on its value: a ValueError names the keyword."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        check = field.metadata["check"]
        if check is not None:
            try:
                check(value)
            except ValueError as e:
                named = str(e).startswith(field.name)
                raise ValueError(str(e) if named else f"{field.name}: {e}") from None


def log_inert_fields(args) -> None:
    """One line for each inert option given a value other than its default."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        why = field.metadata["inert"]
        if why and value != field.default:
            logger.info("%s=%r has no effect in pagedjax: %s", field.name, value, why)


def refuse_unless(allowed: Callable[[Any], bool], why: str) -> Callable[[Any], None]:
    """A field check: ValueError (``why``, with the value) for a value ``allowed`` rejects."""

    def check(value) -> None:
        if not allowed(value):
            raise ValueError(f"{why}, got {value!r}")

    return check
