"""The routing key of a request: hashes of its prompt's first blocks of text, chained so that
two prompts share the first k hashes exactly when they share their first k blocks. Text (not
token) blocks: the ingress routes before any tokenizer runs; a shared text prefix is a shared
token prefix up to the last block's edge."""

from __future__ import annotations

import hashlib
import json

BLOCK_CHARS = 64  # characters per routing block
MAX_BLOCKS = 16  # only a prompt's start matters for routing


def prompt_text(body: bytes) -> str:
    """The prompt's text from a /v1/completions or /v1/chat/completions body ('' when there is
    none, or the body cannot be read: not JSON, nested deeper than the parser recurses, a lone
    surrogate: the app itself answers it, as the plain server does)."""
    try:
        return _prompt_text(body)
    except (ValueError, UnicodeError, RecursionError, TypeError):
        return ""


def _prompt_text(body: bytes) -> str:
    req = json.loads(body)
    if not isinstance(req, dict):
        return ""
    if "messages" in req:
        return json.dumps(req["messages"], sort_keys=True, ensure_ascii=False)
    prompt = req.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[0] if len(prompt) == 1 else json.dumps(prompt)
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def block_hashes(text: str) -> list[str]:
    """Chained hashes of the full BLOCK_CHARS-character blocks of ``text`` (at most MAX_BLOCKS;
    a prompt shorter than one block gives one hash of the whole prompt)."""
    n = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    if n == 0:
        return [hashlib.blake2b(_bytes(text), digest_size=8).hexdigest()] if text else []
    out, h = [], b""
    for i in range(n):
        block = _bytes(text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS])
        h = hashlib.blake2b(h + block, digest_size=8).digest()
        out.append(h.hex())
    return out


def _bytes(text: str) -> bytes:
    """UTF-8, lone surrogates too (a body may hold "\\ud800": the app refuses it, the router
    only hashes it)."""
    return text.encode("utf-8", "surrogatepass")
