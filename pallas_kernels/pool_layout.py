"""How a platform stores the KV pool, so that its kernels read the pool where it lies.

The pool's arrays are ``[num_kv_heads, num_blocks, block_size, head_dim]`` pages and, for an
8-bit pool, f32 scales ``[num_kv_heads, num_blocks, scale_width]`` (token ``t`` of a block at
column ``t``). On a CPU or GPU ``head_dim`` is the model's and ``scale_width`` the block size.

On a TPU both are padded to whole 128-lane rows:
- XLA:TPU gives an array whose last dimension is not a multiple of 128 lanes a layout with
  another dimension minor (``{1,3,2,0}`` for bf16[H, N, 16, 64]: no lane padding), while a
  Mosaic kernel reads its operands row-major: every step would copy the whole pool into the
  kernel's layout and back. Row-major, such a page takes 128 lanes anyway (T(8,128) tiles).
- A Mosaic DMA moves whole 512-byte rows (the contiguous inner slice of a transfer must be a
  multiple of 512 bytes): one block's scales, 16 or 32 floats, cannot be copied alone, but a
  128-float row can. Padded, the scales of a block take 512 bytes, as its tiled row would.
- The scales' rows (every layer's blocks) are a multiple of 8, a f32 tile's: XLA:TPU lays
  f32[8, N, 128] out with the heads second-minor when N is not (less tile padding), a layout
  the kernels do not read. The rows past the pool's blocks are never addressed.
Padded columns hold zeros (pages) or are never read (scales).
"""

from __future__ import annotations

import dataclasses

LANES = 128  # a TPU vector register's lanes; 128 f32 = one 512-byte DMA row


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The stored ``head_dim`` of the pages, the width of an 8-bit pool's scale rows, and the
    multiple their number of rows is rounded up to."""

    head_dim: int
    scale_width: int
    scale_row_multiple: int = 1

    def scale_rows(self, num_blocks: int) -> int:
        """Rows of scales for a pool of ``num_blocks`` blocks (every layer's)."""
        return _round_up(num_blocks, self.scale_row_multiple)


def pool_layout(platform: str, block_size: int, head_dim: int) -> PoolLayout:
    """The pool layout the kernels of ``platform`` ("tpu", "gpu"/"cuda", "cpu") read in place."""
    if platform == "tpu":
        return PoolLayout(_round_up(head_dim, LANES), _round_up(block_size, LANES), 8)
    return PoolLayout(head_dim, block_size)
