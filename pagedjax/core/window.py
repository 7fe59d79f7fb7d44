"""Sliding-window block arithmetic: which blocks a sequence still needs, and how many at most.

Pure Python; imports no jax. Window semantics are HF's: the query at position p attends to the
keys at positions (p - window, p]. The next step's first query is at the sequence's
num_computed_tokens, so every block whose positions all lie at or before
num_computed_tokens - window is never read again (the kernels start their key loop at the
window's first block) and can be freed.

Only when every layer shares one window (Mistral, Mixtral, Phi-3 with a window). With mixed local
and global layers (Gemma 2/3, Qwen's max_window_layers) all layers share one block table and the
global layers read every block, so nothing is freed.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedjax.utils import cdiv


def shared_window(layer_windows: Iterable[int]) -> int | None:
    """The window when every layer slides with the same one, else None (the rule of
    models/layers.py ``static_window``; 0 means a global layer)."""
    windows = set(layer_windows)
    return windows.pop() if len(windows) == 1 and 0 not in windows else None


def first_live_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Index of the first block the next step may read: the block of position
    num_computed_tokens - window + 1. Every block before it holds only positions
    <= num_computed_tokens - window."""
    return max(0, (num_computed_tokens - window + 1) // block_size)


def live_blocks(window: int, chunk: int, block_size: int) -> int:
    """Most blocks a sequence holds during a step that computes ``chunk`` tokens: positions
    [p - window + 1, p + chunk - 1] (window + chunk - 1 of them) at any offset in a block."""
    return cdiv(window + chunk + block_size - 2, block_size)


def max_chunk_that_fits(window: int, num_usable_blocks: int, block_size: int) -> int:
    """The longest chunk whose live_blocks fit num_usable_blocks (< 1: not even a decode)."""
    return num_usable_blocks * block_size - window - block_size + 2
