"""A grammar's text as llguidance's Lark: Lark as it is, GBNF (llama.cpp's, ``root ::= ...``)
converted. llguidance's own test for Lark misses a start rule written ``?start:`` (vLLM's
structured outputs example writes it so): a text without ``::=`` is Lark here."""

from __future__ import annotations

import re

_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][A-Za-z0-9_-]*\s*::=")


def grammar_lark(text: str) -> str:
    """llguidance's grammar definition of a Lark or GBNF text; ValueError naming what is wrong."""
    import llguidance

    if _GBNF_RULE.search(text) is None:
        return llguidance.LLMatcher.grammar_from_lark(text)
    return llguidance.grammar_from("grammar", text)
