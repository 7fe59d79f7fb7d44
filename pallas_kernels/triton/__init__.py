"""The Triton backend: Pallas kernels for NVIDIA GPUs through the Triton lowering.

Decode (``decode.py``): one program per (sequence, KV head, context partition), partitions merged
afterwards (vLLM's paged-attention v2). Ragged (``ragged.py``): one program per (sequence, KV
head, tile of its query rows). Float32 runs at float32 precision (``lowering.dot_precision``).
"""

from __future__ import annotations

import dataclasses

from ..backend import AttentionBackend, zero_unowned_rows
from .decode import triton_decode
from .ragged import triton_prefill

__all__ = ["TritonBackend", "supports_shapes"]


def supports_shapes(block_size: int, head_dim: int) -> bool:
    """Shapes the kernels tile (powers of two; head_dim >= 16)."""
    pow2 = lambda n: n > 0 and not n & (n - 1)  # noqa: E731
    return pow2(block_size) and pow2(head_dim) and head_dim >= 16


@dataclasses.dataclass(frozen=True)
class TritonBackend(AttentionBackend):
    """Tuning knobs: ``pages_per_block`` pages per key step (a power of two with at least 16
    tokens; default 128 tokens for decode, 64 for ragged); ``partition_size`` tokens per decode
    context partition (a multiple of the step; default: split until about 512 programs);
    ``block_q`` query rows per ragged tile (a power of two, times the GQA group padded to a power
    of two, at least 16); ``num_warps``/``num_stages`` for Triton; ``interpret=True`` runs the
    kernels in interpret mode (tests on CPU)."""

    name = "triton"
    follows_context = True  # partitions past a context length return at once
    interpret: bool = False
    pages_per_block: int | None = None
    partition_size: int | None = None
    block_q: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def decode(self, q, kv, md, opts):
        return triton_decode(
            q,
            kv,
            md,
            opts,
            pages_per_block=self.pages_per_block,
            partition_size=self.partition_size,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            interpret=self.interpret,
        )

    def prefill(self, q, kv, md, opts):
        out = triton_prefill(
            q,
            kv,
            md,
            opts,
            block_q=self.block_q,
            pages_per_block=self.pages_per_block,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            interpret=self.interpret,
        )
        return zero_unowned_rows(out, md)
