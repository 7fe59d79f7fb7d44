"""The reference backend: the pure-jnp oracles, and nothing else (no kernel, no native call)."""

from __future__ import annotations

import dataclasses

from ..backend import AttentionBackend
from .decode import gather_context, reference_decode
from .ragged import TILE_ROWS, reference_prefill

__all__ = ["ReferenceBackend", "gather_context", "reference_decode", "reference_prefill"]


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(AttentionBackend):
    name = "reference"
    follows_rows = True
    tile_rows: int = TILE_ROWS  # packed rows per tile of the ragged oracle

    def decode(self, q, kv, md, opts):
        return reference_decode(q, kv, md, opts)

    def prefill(self, q, kv, md, opts):
        return reference_prefill(q, kv, md, opts, tile_rows=self.tile_rows)
