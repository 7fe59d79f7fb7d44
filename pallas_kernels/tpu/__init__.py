"""The TPU backend: Pallas kernels lowered by Mosaic TPU.

Decode (``decode.py``): one program per (sequence, KV head, partition), pages copied into
double-buffered VMEM tiles. Ragged (``ragged.py``): one program per (KV head, tile of packed
rows), looping over the sequences owning the tile's rows. The KV write (``write.py``): a scatter
that XLA:TPU runs in place on the pool's row-major layout. The pool itself is stored padded to
whole 128-lane rows (``pool_layout.py``).
"""

from __future__ import annotations

import dataclasses

from ..backend import AttentionBackend, zero_unowned_rows
from ..metadata import PagedKV
from .decode import MAX_TABLE_ENTRIES, tpu_decode
from .ragged import tpu_prefill
from .write import write_kv_rows

__all__ = ["TpuBackend"]


@dataclasses.dataclass(frozen=True)
class TpuBackend(AttentionBackend):
    """Tuning knobs: ``pages_per_block`` pages per key step (default 256 tokens for decode, 128
    for ragged); ``partition_size`` tokens per decode context partition (default: no split, a
    TensorCore runs its grid in sequence); ``block_q`` packed rows per ragged tile (a multiple of
    8); ``max_table_entries`` block-table entries prefetched into SMEM per decode call;
    ``interpret=True`` runs the kernels in TPU interpret mode (tests on CPU)."""

    name = "tpu"
    follows_rows = True  # the ragged kernel's grid tiles the packed rows, whatever the queries
    follows_context = True  # pages past a context length are never copied in
    interpret: bool = False
    pages_per_block: int | None = None
    partition_size: int | None = None
    block_q: int | None = None
    max_table_entries: int = MAX_TABLE_ENTRIES

    def write_kv(self, kv, k_new, v_new, slot_mapping):
        """In place on the row-major pool the kernels read (tpu/write.py says why)."""
        return PagedKV(
            *write_kv_rows(kv.k_pages, kv.v_pages, k_new, v_new, slot_mapping, *kv.scales)
        )

    def decode(self, q, kv, md, opts):
        return tpu_decode(
            q,
            kv,
            md,
            opts,
            pages_per_block=self.pages_per_block,
            partition_size=self.partition_size,
            max_table_entries=self.max_table_entries,
            interpret=self.interpret,
        )

    def prefill(self, q, kv, md, opts):
        out = tpu_prefill(
            q,
            kv,
            md,
            opts,
            block_q=self.block_q,
            pages_per_block=self.pages_per_block,
            interpret=self.interpret,
        )
        return zero_unowned_rows(out, md)
