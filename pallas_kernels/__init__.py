"""Kernels for paged attention and their pure-jnp references. Arrays in, arrays out.

Attention backends, one folder each: ``triton/`` (GPU), ``tpu/``, ``cpu/`` (native C++ kernels),
``reference/`` (the oracle); ``selection.select_backend`` chooses one. ``attention.py`` holds the
public flat functions over them.
"""

from .attention import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from .backend import AttentionBackend
from .cpu import NativeBackend
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
from .metadata import AttentionMetadata, AttentionOptions, PagedKV
from .reference import ReferenceBackend
from .selection import BACKENDS, backend_setting, select_backend
from .tpu import TpuBackend
from .triton import TritonBackend

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionOptions",
    "NativeBackend",
    "PagedKV",
    "ReferenceBackend",
    "TpuBackend",
    "TritonBackend",
    "backend_setting",
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
    "scatter_blocks",
    "scatter_blocks_reference",
    "select_backend",
    "unpack_stacked",
    "unpack_table",
    "write_kv",
    "write_kv_reference",
]
