"""Tool-call parsers by name, as ``--tool-call-parser NAME`` chooses them: each reads one model
family's way of writing calls (base.py says what a parser is)."""

from __future__ import annotations

from pagedjax.entrypoints.openai.tool_parsers.base import (
    DeltaStream,
    ParsedCall,
    ToolParser,
    call_json,
    extract,
    new_call_id,
)
from pagedjax.entrypoints.openai.tool_parsers.hermes import HermesParser
from pagedjax.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonParser
from pagedjax.entrypoints.openai.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}

__all__ = [
    "PARSERS",
    "DeltaStream",
    "ParsedCall",
    "ToolParser",
    "call_json",
    "extract",
    "get_parser",
    "new_call_id",
]


def get_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name``; a ValueError lists the names there are."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}"
        ) from None
