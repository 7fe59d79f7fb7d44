"""A stand-in for the engine's ``Runner`` on a target machine that is not here: the attributes
the warm-up's lowering reads (worker/warmup_jobs.py), with the weights and the KV pool as
ShapeDtypeStructs placed on the target's compile-only devices.

The weights are laid out as the target's runner lays them out at load
(``process_weights_after_loading``: one tree per layer off a CPU, XLA's linear methods), split
over a tensor-parallel mesh as ``shard_params`` splits them; the pool is shaped for the target's
platform (models/llama.py's ``kv_pool_shapes``: a TPU's rows padded to 128 lanes) and sized as
the engine sizes it (``num_blocks``, else ``kv_cache_space_gib``, else ``gpu_memory_utilization``
of a device's memory less the weights). Nothing is allocated: lowering the warm-up's jobs with
this object compiles what the engine would run there.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pagedjax import pallas_kernels
from pagedjax.config import EngineConfig
from pagedjax.models import quant
from pagedjax.models.config import ModelConfig
from pagedjax.models.layer_loop import ENV_LAYER_LOOP, check_layer_loop
from pagedjax.models.linear import process_weights_after_loading
from pagedjax.models.llama import kv_pool_bytes_per_block, kv_pool_shapes, param_shapes
from pagedjax.models.quant import compute_dtype
from pagedjax.models.sharding import (
    AXIS,
    param_shardings,
    pool_sharding,
    replicate_kv_heads,
    scales_sharding,
    sharded_config,
)
from pagedjax.worker import step_program
from pagedjax.worker.input_batch import InputBatcher
from pagedjax.worker.kv_cache import KVCache, num_host_blocks, pool_dtype
from pagedjax.worker.runner import Runner

from .targets import GIB, Target, device_grid

# The platform name JAX's backend selection and the pool layout use for a target's platform
PLATFORMS = {"tpu": "tpu", "cuda": "gpu"}


class TargetKVCache(KVCache):
    """The KV cache's block moves (``lower_block_op``) over a pool of ShapeDtypeStructs."""

    def __init__(self, config: ModelConfig, *, num_blocks, block_size, dtype, pages):
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = 0
        self.dtype = dtype
        self.pages = pages
        self.host_pool = {}


class TargetRunner:
    """What ``warmup_jobs`` and ``startup_jobs`` read of a runner, for ``target``."""

    verifies_draft_probs = False  # a draft model's runner verifies with q rows: not modelled
    lora_slots = None  # LoRA's slots are not modelled
    sampling_input = Runner.sampling_input  # the runner's own

    def __init__(self, model: ModelConfig, engine: EngineConfig, target: Target, layer_loop=None):
        tp = engine.tensor_parallel_size
        if tp > target.chips:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} devices; target {target.name!r} has "
                f"{target.chips}"
            )
        self.target, self.platform = target, PLATFORMS[target.platform]
        devices = device_grid(target)[:tp]
        self.mesh = Mesh(devices, (AXIS,)) if tp > 1 else None
        # Lowering runs inside this mesh (jax.set_mesh), so Pallas sees the target's chip.
        self.lowering_mesh = Mesh(devices, (AXIS,))
        self._single = SingleDeviceSharding(devices[0])
        self.config = sharded_config(model, tp)  # KV heads replicated when tp > num_kv_heads
        self.layer_loop = check_layer_loop(
            layer_loop or os.environ.get(ENV_LAYER_LOOP, "").strip().lower() or "unrolled"
        )
        self.params, self.linear = self._weights(model, engine, tp)
        self.dtype = compute_dtype(self.params)
        cache, sched = engine.cache, engine.scheduler
        self.block_size = cache.block_size
        dtype = pool_dtype(cache.kv_cache_dtype, engine.dtype)
        block_bytes = kv_pool_bytes_per_block(self.config, cache.block_size, dtype, self.platform)
        self.num_blocks = cache.num_blocks or self._pool_blocks(engine, block_bytes, tp)
        self.num_host_blocks = num_host_blocks(cache, block_bytes)
        self.kv_cache = TargetKVCache(
            self.config,
            num_blocks=self.num_blocks,
            block_size=cache.block_size,
            dtype=dtype,
            pages=self._pool(dtype),
        )
        self.backend = pallas_kernels.select_backend(
            platform=self.platform, block_size=cache.block_size, head_dim=self.config.head_dim
        )
        spec = engine.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        # Built as the Runner builds its own (worker/runner.py): the same buckets.
        self.batcher = InputBatcher(
            cache.block_size,
            sched.max_model_len,
            1 + self.num_speculative_tokens,
            follows_context=self.backend.follows_context,
            max_num_seqs=sched.max_num_seqs,
        )
        self.batcher.query_buckets = not self.backend.follows_rows
        self.max_blocks_per_seq = self.batcher.max_blocks_per_seq
        self.max_model_len = sched.max_model_len
        self.fill_width = step_program.fill_width(sched.max_num_seqs)

    # ---- what warm-up reads ------------------------------------------------------------------

    def step_shapes(self, max_num_seqs: int, max_num_batched_tokens: int):
        return self.batcher.step_shapes(max_num_seqs, max_num_batched_tokens)

    def place(self, tree):
        """Host arrays as the abstract inputs of a program (placed as the runner places them:
        replicated over the mesh, or on the one device)."""
        sharding = self._inputs()
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
        )

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool on one device."""
        return sum(_device_bytes(a) for a in self.kv_cache.pages)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights on one device."""
        return sum(_device_bytes(a) for a in jax.tree.leaves(self.params))

    def pool_leaf_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, per-device shape) of each pool array, as the compiled program sees them."""
        return [(a.dtype.name, _device_shape(a)) for a in self.kv_cache.pages]

    def weight_shapes(self) -> set[tuple[str, tuple[int, ...]]]:
        """(dtype, per-device shape) of one layer's share of each weight (a stacked weight's
        row): the shapes a copy or a slice of a weight would have."""
        out = set()
        for a in jax.tree.leaves(self.params):
            shape = _device_shape(a)
            out.add((a.dtype.name, shape))
            if self.layer_loop == "scan" and len(shape) > 1:
                out.add((a.dtype.name, shape[1:]))
        return out

    # ---- building ------------------------------------------------------------------------------

    def _inputs(self):
        return NamedSharding(self.mesh, PartitionSpec()) if self.mesh else self._single

    def _weights(self, model: ModelConfig, engine: EngineConfig, tp: int):
        params = param_shapes(model, engine.dtype)
        if engine.quantization is not None:
            params = quant.quantized_shapes(params, engine.quantization)
        params = jax.eval_shape(lambda p: replicate_kv_heads(p, model, tp), params)
        params, linear = process_weights_after_loading(
            params, self.config, None, layer_loop=self.layer_loop
        )
        shardings = (
            param_shardings(params, self.mesh)
            if self.mesh
            else jax.tree.map(lambda _: self._single, params)
        )
        placed = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings
        )
        return placed, linear

    def _pool_blocks(self, engine: EngineConfig, block_bytes: int, tp: int) -> int:
        """The engine's pool size (worker/kv_cache.py's ``num_device_blocks``) on the target:
        what ``gpu_memory_utilization`` of a device's allocator leaves after the weights."""
        cache = engine.cache
        if cache.kv_cache_space_gib is not None:
            return int(cache.kv_cache_space_gib * GIB // block_bytes)
        budget = int(cache.gpu_memory_utilization * self.target.allocator_bytes)
        budget -= self.weight_bytes
        if budget <= 0:
            raise ValueError(
                f"the weights ({self.weight_bytes / GIB:.2f} GiB per device) leave no memory for "
                f"the KV cache on {self.target.name} at gpu_memory_utilization="
                f"{cache.gpu_memory_utilization} of {self.target.allocator_bytes / GIB:.1f} GiB"
            )
        return int(budget // (block_bytes // tp))

    def _pool(self, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
        shapes = kv_pool_shapes(
            self.config, self.num_blocks, self.block_size, dtype, platform=self.platform
        )
        pages = pool_sharding(self.mesh) if self.mesh else self._single
        scales = scales_sharding(pages)
        return tuple(
            jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=pages if i < 2 else scales)
            for i, s in enumerate(shapes)
        )


def _device_shape(a: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    return tuple(a.sharding.shard_shape(a.shape))


def _device_bytes(a: jax.ShapeDtypeStruct) -> int:
    return math.prod(_device_shape(a)) * np.dtype(a.dtype).itemsize
