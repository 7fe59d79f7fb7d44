"""Small integer helpers shared by the host side (the kernels, a lower layer, keep their own),
vLLM's FlexibleArgumentParser where vLLM's examples import it (``vllm.utils``), and where
pagedjax's own log lines go (log_setup.py)."""

from __future__ import annotations

from pagedjax.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser", "cdiv", "next_pow2", "powers_of_two"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def next_pow2(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def powers_of_two(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` (both powers of two), inclusive."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out
