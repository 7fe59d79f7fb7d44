"""A step's grammar rows advanced and masked together, in parallel, with the GIL released.

After each step every constrained sequence takes its new token and computes the mask of the tokens
it may sample next. Done sequence by sequence that is one native call per sequence on the engine
thread; here a step's sequences take their k-th new tokens in one call (``consume_token_par``) and
compute all their masks in one call (``fill_next_token_bitmask_par``), on llguidance's own thread
pool with the GIL released, so the server's event loop and its other threads run meanwhile.

Each mask's work is bounded by the parser limits every matcher is built with
(``structured_limits.parser_limits``): a grammar that needs more in one step puts its matcher in
an error state, which ends that sequence "abort" with the limit named (``RequestGrammar``), never
a longer step for everyone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedjax.utils import cdiv

_executor = None  # llguidance.LLExecutor, made on first use
_executor_lock = threading.Lock()


def executor():
    """The process's llguidance thread pool (its default size: most of the CPUs, at most 32)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


def mask_width(vocab_size: int) -> int:
    """32-bit words of a token bitmask over the vocabulary (llguidance's and the sampler's)."""
    return cdiv(vocab_size, 32)


def consume(items: Sequence[tuple[Any, Sequence[int]]]) -> None:
    """Each (matcher, tokens) takes its tokens in order: the k-th tokens of all of them in one
    call. A token a matcher refuses leaves it in an error state (as ``consume_token`` does)."""
    pending = [(m, tokens) for m, tokens in items if len(tokens)]
    k = 0
    while pending:
        executor().consume_token_par([(m, int(tokens[k])) for m, tokens in pending])
        k += 1
        pending = [(m, tokens) for m, tokens in pending if len(tokens) > k]


def fill(matchers: Sequence[Any], vocab_size: int) -> np.ndarray:
    """i32[len(matchers), ceil(vocab / 32)]: bit t of row i set if matchers[i] allows token t,
    all rows in one call. A matcher the computation puts in an error state (a parser limit) gets
    a row of zeros."""
    out = np.zeros((len(matchers), mask_width(vocab_size)), np.int32)
    if matchers:
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(executor(), [(m, i) for i, m in enumerate(matchers)], out)
        for i, m in enumerate(matchers):
            if m.is_error():
                out[i] = 0
    return out


def advance_together(pairs: Sequence[tuple[Any, Any]]) -> None:
    """For each (RequestGrammar, sequence): take the sequence's new tokens and compute the mask it
    samples with next, every pair at once (grammars of one vocabulary share one call).
    ``RequestGrammar.after_token`` and ``mask`` then find the work done."""
    work = [(g, seq, *g.matcher_behind(seq)) for g, seq in pairs]
    consume([(matcher, tokens) for _, _, matcher, tokens in work])
    wanted: dict[int, list[tuple[Any, Any, Any]]] = {}  # vocab size -> (grammar, seq, matcher)
    for g, seq, matcher, _ in work:
        if g.wants_mask(seq, matcher):
            wanted.setdefault(g.compiled.vocab_size, []).append((g, seq, matcher))
    for vocab_size, rows in wanted.items():
        masks = fill([matcher for _, _, matcher in rows], vocab_size)
        for (g, seq, _), mask in zip(rows, masks, strict=True):
            g.keep_mask(seq, mask)


def check_allowed_ids_meet(first_mask: np.ndarray, token_ids, constraint: str) -> None:
    """Refuse (ValueError naming both) ``allowed_token_ids`` that allow none of the tokens a
    constraint allows first (``first_mask``: its i32 bitmask): the request could only end with
    no token."""
    words = first_mask.view(np.uint32)
    ids = np.asarray(sorted(set(token_ids)), np.int64)
    ids = ids[ids < 32 * len(words)]
    if not ((words[ids // 32] >> (ids % 32).astype(np.uint32)) & 1).any():
        shown = sorted(set(token_ids))[:8]
        raise ValueError(
            f"allowed_token_ids {shown}{' ...' if len(set(token_ids)) > 8 else ''} and "
            f"structured_outputs.{constraint} have no token in common: no first token could be "
            "sampled"
        )
