"""The model entry points the engine calls, for every family: ``forward``, the stacked KV pool
(``init_kv_pool``, ``kv_pool_shapes``, ``layer_block``, ``kv_pool_bytes_per_block``) and
``param_shapes``.

``forward(params, kv_pool, step_input, config)`` is a pure function returning ``(logits,
kv_pool)``. Every supported family (models/registry.py) is a config-driven variant of the shared
decoder (models/decoder.py), so one model class serves them all; the config says which variant.

The pool is one K and one V array for all layers, ``[num_kv_heads, num_layers * num_blocks,
block_size, head_dim]``: layer ``l``'s block ``b`` is pool block ``l * num_blocks + b``
(``layer_block``). Each layer offsets its slot mapping and block tables by its first block, so
the kernels read and write the layer's pages in place, with no slice of the pool ever copied.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .. import pallas_kernels
from ..pallas_kernels.pool_layout import pool_layout
from .config import ModelConfig
from .decoder import DecoderModel
from .layer_loop import flax_tree, is_per_layer
from .layers import KVPool, apply_rope, rope_inv_freq  # noqa: F401 (re-exported)
from .linear import WeightLayout
from .lora_slots import LoRABatch
from .quant import compute_dtype
from .sharding import scales_sharding
from .step_input import StepInput


def is_kv8(dtype) -> bool:
    """Whether a pool of ``dtype`` is 8-bit (int8 or float8_e4m3fn pages with f32 scales)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def kv_pool_shapes(
    config: ModelConfig, num_blocks: int, block_size: int, dtype, platform: str | None = None
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The pool's arrays as ``init_kv_pool`` makes them for ``platform`` (default: JAX's
    default backend): pages [num_kv_heads, num_layers * num_blocks, block_size, head_dim] and,
    for an 8-bit ``dtype``, f32 scales [num_kv_heads, num_layers * num_blocks, width]; on a TPU
    head_dim and width are padded to whole 128-lane rows and the scales' rows to a multiple of 8
    (pallas_kernels/pool_layout.py)."""
    if config.num_layers * num_blocks * block_size >= 2**31:
        raise ValueError(
            f"num_blocks={num_blocks} x block_size={block_size} x {config.num_layers} layers "
            "exceeds the int32 slot range of the pool"
        )
    layout = pool_layout(platform or jax.default_backend(), block_size, config.head_dim)
    lead = (config.num_kv_heads, config.num_layers * num_blocks)
    pages = (jax.ShapeDtypeStruct((*lead, block_size, layout.head_dim), jnp.dtype(dtype)),) * 2
    if not is_kv8(dtype):
        return pages
    rows = layout.scale_rows(lead[1])  # on a TPU a multiple of 8 (pool_layout.py says why)
    shape = (lead[0], rows, layout.scale_width)
    return pages + (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2


def init_kv_pool(
    config: ModelConfig, num_blocks: int, block_size: int, dtype, sharding=None
) -> KVPool:
    """Zeroed pool of ``num_blocks`` blocks per layer: ``(k_pages, v_pages)``, and for an 8-bit
    ``dtype`` also ``(k_scales, v_scales)`` (one scale per token and kv head), shaped by
    ``kv_pool_shapes`` for the sharding's platform. With a sharding (the pages'), each device
    allocates only its slice; the scales are split by kv heads like the pages."""
    platform = next(iter(sharding.device_set)).platform if sharding is not None else None
    shapes = kv_pool_shapes(config, num_blocks, block_size, dtype, platform)
    pages = tuple(jnp.zeros(s.shape, s.dtype, device=sharding) for s in shapes[:2])
    if len(shapes) == 2:
        return pages
    scales = scales_sharding(sharding) if sharding is not None else None
    return pages + tuple(jnp.ones(s.shape, s.dtype, device=scales) for s in shapes[2:])


def layer_block(pool: jax.Array, config: ModelConfig, layer: int, block):
    """The pool index of ``layer``'s block ``block`` (an int or an array of them)."""
    return layer * (pool.shape[1] // config.num_layers) + block


def layer_pages(pool: jax.Array, config: ModelConfig, layer: int) -> jax.Array:
    """``layer``'s pages, [num_kv_heads, num_blocks, block_size, head_dim] (a copy: for tests and
    inspection, never inside a step)."""
    num_blocks = pool.shape[1] // config.num_layers
    return pool[:, layer * num_blocks : (layer + 1) * num_blocks]


def kv_pool_bytes_per_block(
    config: ModelConfig, block_size: int, dtype, platform: str | None = None
) -> int:
    """Bytes of one block in every layer, K and V, as ``kv_pool_shapes`` stores it on
    ``platform``: the pages, plus an 8-bit pool's f32 scale rows (a row per block and layer;
    the few spare rows a TPU rounds up to are not the blocks')."""
    shapes = kv_pool_shapes(config, 1, block_size, dtype, platform)
    row_bytes = [math.prod(s.shape) // s.shape[1] * s.dtype.itemsize for s in shapes]
    return config.num_layers * sum(row_bytes)


def forward(
    params,
    kv_pool: KVPool,
    step_input: StepInput,
    config: ModelConfig,
    backend: pallas_kernels.AttentionBackend | str | None = None,
    mesh: Mesh | None = None,
    layout: WeightLayout | None = None,
    lora: LoRABatch | None = None,
):
    """Pure forward: ``(params, kv_pool, step_input) -> (logits f32[num_logits, vocab], kv_pool)``
    (``forward_hidden``: also the last layer's output of every token row).

    The compute dtype is the embedding's (linear kernels may be 8-bit: models/quant.py). With a
    ``mesh``, parameters and pool are sharded by heads (models/sharding.py) and attention runs
    per device under shard_map. ``backend``: the attention backend object (the runner's); a
    name or None (the setting, else the platform's) picks one here (``select_backend``).
    ``params`` stacked run the layers under a scan; split per layer (``split_layers``, chosen
    at load: models/layer_loop.py) they run unrolled. ``layout``: the linear methods the
    weights were processed for (``process_weights_after_loading``, models/linear.py; default:
    XLA's, for weights as loaded). ``lora``: per-row LoRA adapters (models/lora.py), each
    targeted projection adding its row's adapter product; None compiles no LoRA op.
    """
    model = _model(params, config, backend, mesh, layout)
    return _apply(model, params, kv_pool, step_input, lora)


def forward_hidden(
    params,
    kv_pool: KVPool,
    step_input: StepInput,
    config: ModelConfig,
    backend: pallas_kernels.AttentionBackend | str | None = None,
    mesh: Mesh | None = None,
    layout: WeightLayout | None = None,
    lora: LoRABatch | None = None,
):
    """``forward``, also returning the last layer's output of every token row, [num_tokens,
    hidden]: ``(logits, kv_pool, hidden)`` (``head_logits`` turns rows of it into logits: prompt
    logprobs score them)."""
    model = _model(params, config, backend, mesh, layout)
    return _apply(model, params, kv_pool, step_input, lora, return_hidden=True)


def _apply(model, params, kv_pool, step_input, lora, return_hidden: bool = False):
    args = (kv_pool, step_input, lora)
    return model.apply({"params": flax_tree(params)}, *args, return_hidden=return_hidden)


def head_logits(
    params,
    hidden_rows: jax.Array,  # [rows, hidden]: rows of ``forward``'s hidden output
    config: ModelConfig,
    backend: pallas_kernels.AttentionBackend | str | None = None,
    mesh: Mesh | None = None,
    layout: WeightLayout | None = None,
) -> jax.Array:
    """The logits f32[rows, vocab] of rows of the last layer's output, as ``forward`` computes
    them (final norm, head, soft cap)."""
    model = _model(params, config, backend, mesh, layout)
    return model.apply({"params": flax_tree(params)}, None, None, hidden_rows=hidden_rows)


def _model(params, config, backend, mesh, layout) -> DecoderModel:
    dtype = compute_dtype(params)
    backend = pallas_kernels.select_backend(backend)  # an object as is; else by name or setting
    loop = "unrolled" if is_per_layer(params) else "scan"
    return DecoderModel(config, dtype, backend, mesh, loop, layout or WeightLayout())


@functools.lru_cache(maxsize=16)
def param_shapes(config: ModelConfig, dtype_name: str = "float32"):
    """The parameter tree as ShapeDtypeStructs (no memory allocated). Per-layer parameters sit
    under ``"layers"`` with a leading ``num_layers`` axis (a MoE family's MLPs under ``"moe"`` and
    ``"dense_mlp"``, stacked over the layers of each kind)."""
    dtype = jnp.dtype(dtype_name)
    pool_shape = (config.num_kv_heads, 2 * config.num_layers, 4, config.head_dim)
    pool = (jax.ShapeDtypeStruct(pool_shape, dtype),) * 2
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    step = StepInput(
        i32((1,)),
        i32((1,)),
        i32((1,)),
        i32((1, 1)),
        i32((1,)),
        i32((2,)),
        i32((1,)),
        max_query_len=1,
    )
    model = DecoderModel(config, dtype, pallas_kernels.ReferenceBackend())
    shapes = jax.eval_shape(lambda p, s: model.init(jax.random.key(0), p, s), pool, step)
    return shapes["params"]
