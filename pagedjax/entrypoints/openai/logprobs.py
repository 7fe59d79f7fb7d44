"""Logprob fields in OpenAI's two shapes: a token's raw bytes (chat) and where each token starts
in the completion's text (completions)."""

from __future__ import annotations

import json
import re

from pagedjax.outputs import PromptLogprobsList

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are spelt in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer) -> bool:
    """Whether a fast tokenizer's decoder is (or contains) the byte-level one."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    return any(d.get("type") == "ByteLevel" for d in [state, *state.get("decoders", [])])


class TokenStrings:
    """A token id's text (as vLLM shows it: the token decoded alone) and its raw bytes, so that
    the bytes of the pieces of one character (an emoji split over tokens) join back into it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = tokenizer is not None and _is_byte_level(tokenizer)
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self._text[token_id] = self._decoded(token_id)
        return s

    def _decoded(self, token_id: int) -> str:
        tok = self.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = list(self._raw_bytes(token_id))
        return b

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = None
        if self.tokenizer is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return self._decoded(token_id).encode()
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m[1], 16)])
        if self.byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if piece.startswith("▁"):  # SentencePiece: a word-initial space, dropped when decoded alone
            return piece.replace("▁", " ").encode()
        return self._decoded(token_id).encode()


class TokenIds(TokenStrings):
    """Tokens shown as ``token_id:N`` (vLLM's return_tokens_as_token_ids: a token that is not
    valid text alone stays identifiable); chat's bytes are still the token's own."""

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


class TextOffsets:
    """Where each generated token starts in the completion's text.

    Replays the engine's incremental detokenisation (vLLM's: decode a short window, keep only
    complete text) from the same prompt context, so a token's offset is the length of the text
    the engine had emitted before it. Pieces of one character share the character's offset.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        context = prompt_ids[-5:]
        self.ids = list(context)
        self.prefix, self.read = 0, len(context)
        self.length = 0  # characters emitted so far
        self.pieces: list[str] = []  # the text emitted so far (before a stop string cut it)

    def feed(self, token_ids: list[int]) -> list[int]:
        offsets = []
        for t in token_ids:
            offsets.append(self.length)
            if self.tokenizer is None:
                continue
            self.ids.append(t)
            dec = self.tokenizer.decode
            prefix_text = dec(self.ids[self.prefix : self.read], skip_special_tokens=True)
            full = dec(self.ids[self.prefix :], skip_special_tokens=True)
            if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
                self.pieces.append(full[len(prefix_text) :])
                self.length += len(self.pieces[-1])
                del self.ids[: self.read]
                self.prefix, self.read = 0, len(self.ids)
        return offsets

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _by_text(strings: TokenStrings, pairs) -> dict[str, float]:
    """OpenAI's legacy top_logprobs, keyed by token text: tokens that decode alike (bytes of a
    split character all read U+FFFD) share one key, which keeps the highest logprob."""
    out: dict[str, float] = {}
    for t, v in pairs:
        key = strings.text(t)
        out[key] = max(v, out.get(key, v))
    return out


def _values(entry: dict) -> dict[int, float]:
    """A generated token's logprobs (token id -> Logprob) as floats."""
    return {t: v.logprob for t, v in entry.items()}


def completion_logprobs(strings: TokenStrings, token_ids, logprobs, k: int, offsets) -> dict:
    tokens, token_lps, tops = [], [], []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        lp = _values(entry)
        tokens.append(strings.text(tid))
        token_lps.append(lp.get(tid))
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        tops.append(_by_text(strings, top) if k else None)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": list(offsets[: len(tokens)]),
    }


def chat_logprobs(strings: TokenStrings, token_ids, logprobs, k: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        lp = _values(entry)
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        content.append(
            {
                "token": strings.text(tid),
                "logprob": lp.get(tid),
                "bytes": strings.bytes(tid),
                "top_logprobs": [
                    {"token": strings.text(t), "logprob": v, "bytes": strings.bytes(t)}
                    for t, v in top
                ],
            }
        )
    return {"content": content}


def prompt_completion_logprobs(
    strings: TokenStrings, prompt_ids, prompt_logprobs: PromptLogprobsList, k: int
) -> dict:
    """The echoed prompt's part of a completion's logprobs (OpenAI's legacy shape, as vLLM):
    the first token has no logprob; each other token's top_logprobs holds it and the k most
    likely (logprobs floored at -9999: JSON has no -inf). Read from RequestOutput.prompt_logprobs'
    arrays (their top columns are ranks 1, 2, ...): an echoed prompt's thousands of Logprob
    objects are never built."""
    logprobs, _, top_ids, top_logprobs = prompt_logprobs.arrays
    own, ids, lps = logprobs.tolist(), top_ids[:, :k].tolist(), top_logprobs[:, :k].tolist()
    token_lps, tops = [None], [None]
    for j in range(1, len(prompt_ids)):
        tid = prompt_ids[j]
        others = [(t, max(lp, -9999.0)) for t, lp in zip(ids[j], lps[j], strict=True) if t != tid]
        pairs = [(tid, max(own[j], -9999.0)), *others]
        token_lps.append(pairs[0][1])
        tops.append(_by_text(strings, pairs))
    offsets = TextOffsets(strings.tokenizer, []).feed(list(prompt_ids))
    return {
        "tokens": [strings.text(t) for t in prompt_ids],
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def join_logprobs(first: dict, second: dict | None, shift: int) -> dict:
    """``first`` then ``second`` (whose text offsets move by ``shift`` characters)."""
    if second is None:
        return first
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
        "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]],
    }


def vllm_prompt_logprobs(strings: TokenStrings, prompt_logprobs: PromptLogprobsList, k: int):
    """vLLM's ``prompt_logprobs`` field: None for the first prompt token, then per token its
    own and the k most likely, token id -> {logprob, rank, decoded_token} (logprobs floored at
    -9999: JSON has no -inf)."""
    logprobs, ranks, top_ids, top_logprobs = prompt_logprobs.arrays
    own, own_ranks = logprobs.tolist(), ranks.tolist()
    ids, lps = top_ids[:, :k].tolist(), top_logprobs[:, :k].tolist()
    prompt = prompt_logprobs.prompt
    out: list[dict | None] = [None]
    for j in range(1, len(prompt)):
        tid = prompt[j]
        entry = {str(tid): _entry(strings, tid, own[j], own_ranks[j])}
        for rank, (t, lp) in enumerate(zip(ids[j], lps[j], strict=True), 1):
            entry.setdefault(str(t), _entry(strings, t, lp, rank))
        out.append(entry)
    return out


def _entry(strings: TokenStrings, token: int, logprob: float, rank: int) -> dict:
    return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": strings.text(token)}


def clamp(offsets: list[int], text: str) -> list[int]:
    """Text offsets within ``text`` (a stop string may have cut it short)."""
    return [min(o, len(text)) for o in offsets]
