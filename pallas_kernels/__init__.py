"""Pallas kernels for paged attention and their pure-jnp references. Arrays in, arrays out."""

from .kv_cache import (
    copy_blocks,
    copy_blocks_reference,
    gather_blocks,
    gather_blocks_reference,
    quantize_kv,
    scatter_blocks,
    scatter_blocks_reference,
    write_kv,
    write_kv_reference,
)
from .layer_matmul import (
    layer_matmul,
    layer_matmul_reference,
    matmul_transposed,
    matmul_transposed_reference,
    pack_stacked,
    pack_table,
    packed_layer_matmul,
    packed_matmul_transposed,
    packed_take,
    unpack_stacked,
    unpack_table,
)
from .paged_attention import (
    paged_attention,
    paged_attention_reference,
    resolve_backend,
)
from .ragged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "copy_blocks",
    "copy_blocks_reference",
    "gather_blocks",
    "gather_blocks_reference",
    "layer_matmul",
    "layer_matmul_reference",
    "matmul_transposed",
    "matmul_transposed_reference",
    "pack_stacked",
    "pack_table",
    "packed_layer_matmul",
    "packed_matmul_transposed",
    "packed_take",
    "paged_attention",
    "paged_attention_reference",
    "quantize_kv",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_backend",
    "scatter_blocks",
    "scatter_blocks_reference",
    "unpack_stacked",
    "unpack_table",
    "write_kv",
    "write_kv_reference",
]
