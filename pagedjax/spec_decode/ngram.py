"""The n-gram (prompt lookup) proposer: a sequence's own tokens predict how it goes on.

Host side, numpy only. The sequence's last n tokens (the longest n from ``max_n`` down to
``min_n`` that occurred before) are looked up among its earlier tokens, prompt and output alike;
the tokens that followed the earliest such occurrence are the proposal (as vLLM's proposer, which
also takes the earliest of the longest matches). A proposal never runs past the sequence's end, so
a match just before the end proposes fewer tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the earliest of the longest earlier occurrences of the suffix
    of ``tokens`` (i64[num_tokens]) of ``min_n`` .. ``max_n`` tokens; empty if none occurred."""
    num = len(tokens)
    if k <= 0 or num <= min_n:
        return tokens[:0]
    # windows[s] = tokens[s : s + min_n]: every earlier n-gram that ends before the last token
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], min_n)
    starts = np.flatnonzero((windows == tokens[num - min_n :]).all(axis=1))
    if not starts.size:
        return tokens[:0]
    lengths = np.full(starts.size, min_n)
    alive = np.ones(starts.size, bool)
    for n in range(min_n + 1, min(max_n, num - 1) + 1):  # extend each match one token left
        before = starts - (n - min_n)
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[num - n]
        if not alive.any():
            break
        lengths[alive] = n
    end = starts[np.argmax(lengths)] + min_n  # argmax: the earliest of the longest
    return tokens[end : end + k]


class NgramProposer:
    """Proposes up to ``k`` tokens for a sequence from its own history."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        tokens = np.fromiter(token_ids, np.int64, len(token_ids))
        return propose_ngram(tokens, self.min_n, self.max_n, k).tolist()
