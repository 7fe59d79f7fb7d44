"""The KV cache's home: how many blocks the device pool and the host swap space hold, and
``KVCache``, which owns the pool's arrays, their host mirror and the block moves (copy, swap)."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import pallas_kernels
from pagedjax.config import DEFAULT_CPU_KV_SPACE_GIB, CacheConfig, EngineConfig
from pagedjax.core.block_manager import WATERMARK
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import init_kv_pool, kv_pool_bytes_per_block
from pagedjax.models.sharding import min_over_processes
from pagedjax.utils import cdiv

logger = logging.getLogger(__name__)

# kv_cache_dtype -> the pool's page dtype ("auto": the compute dtype)
KV8_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def pool_dtype(kv_cache_dtype: str, compute_dtype) -> jnp.dtype:
    """The pool's page dtype for ``kv_cache_dtype`` (CacheConfig): "auto" is the compute dtype;
    "int8" / "fp8" pages come with f32 scales (one per token and kv head)."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(compute_dtype)
    if kv_cache_dtype not in KV8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {kv_cache_dtype!r}")
    return jnp.dtype(KV8_DTYPES[kv_cache_dtype])


def num_device_blocks(
    cache: CacheConfig, block_bytes: int, tensor_parallel_size: int, useful_blocks: int
) -> int:
    """Blocks for a pool sized by kv_cache_space_gib; else, on a GPU or TPU, by what
    ``device_kv_budget`` leaves each device (each holds 1/tp of every block: its heads); else,
    on a CPU, by DEFAULT_CPU_KV_SPACE_GIB, but no more than ``useful_blocks``, the most the
    engine's running sequences can ever hold: on a CPU the pool's first touch costs about a
    second per GiB, which a small engine (``pagedjax generate``: one sequence) need not pay.
    (An explicit num_blocks needs none of this.)"""
    if cache.kv_cache_space_gib is not None:
        return int(cache.kv_cache_space_gib * 2**30 // block_bytes)
    budget = device_kv_budget(cache.gpu_memory_utilization, jax.local_devices())
    if budget is not None:
        return int(budget // (block_bytes // tensor_parallel_size))
    return min(int(DEFAULT_CPU_KV_SPACE_GIB * 2**30 // block_bytes), useful_blocks)


def device_kv_budget(utilization: float, devices) -> int | None:
    """Bytes the KV pool may take on each of ``devices`` (the least of them): ``utilization``
    (CacheConfig.gpu_memory_utilization, as vLLM's) of what the device's allocator may hold,
    less what it holds now (the weights); the rest is the step programs' workspace. None where
    a device reports no such limit (a CPU). On a GPU the allocator's limit is JAX's share of
    it, XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set); on a TPU, its memory."""
    budgets = []  # (bytes, device, how)
    for device in devices:
        mem = device.memory_stats() if device.platform != "cpu" else None
        if not mem or "bytes_limit" not in mem:
            return None
        limit, used = mem["bytes_limit"], mem.get("bytes_in_use", 0)
        budget = int(utilization * limit) - used
        share = f"{utilization} x {limit / 2**30:.2f} GiB = {utilization * limit / 2**30:.2f} GiB"
        gib = f"{share}, {used / 2**30:.2f} GiB of it in use"
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves no memory for the KV cache on "
                f"{device} ({gib}): raise it, or XLA_PYTHON_CLIENT_MEM_FRACTION on a GPU"
            )
        budgets.append((budget, str(device), gib))
    if not budgets:
        return None
    budget, device, gib = min(budgets)
    logger.info("KV cache: %.2f GiB on %s (%s)", budget / 2**30, device, gib)
    return budget


def useful_blocks(config: EngineConfig, watermark: float = WATERMARK) -> int:
    """Blocks that ``max_num_seqs`` sequences of ``max_model_len`` tokens (plus speculative
    lookahead slots) hold at most, with the null block and the block manager's watermark."""
    sched, block_size = config.scheduler, config.cache.block_size
    spec = config.speculative_config
    per_seq = cdiv(sched.max_model_len + (spec.num_speculative_tokens if spec else 0), block_size)
    return int((sched.max_num_seqs * per_seq + 2) / (1 - watermark)) + 1


def num_host_blocks(cache: CacheConfig, block_bytes: int) -> int:
    return int(cache.swap_space_gib * 2**30 // block_bytes)


def pool_size(config: EngineConfig, device_config: ModelConfig, tp: int):
    """(device blocks, host blocks): an explicit num_blocks, else sized from memory and agreed
    by every process (the smallest)."""
    cache = config.cache
    dtype = pool_dtype(cache.kv_cache_dtype, config.dtype)
    block_bytes = kv_pool_bytes_per_block(device_config, cache.block_size, dtype)
    num_blocks = cache.num_blocks or min_over_processes(
        num_device_blocks(cache, block_bytes, tp, useful_blocks(config))
    )
    return num_blocks, num_host_blocks(cache, block_bytes)


def apply_block_moves(runner, out, cost_model) -> None:
    """A SchedulerOutput's block moves, before its step: swaps (timed, for the scheduler's
    swap-or-recompute costs), then copy-on-write."""
    for pairs, move in (
        (out.blocks_to_swap_out, runner.swap_out),
        (out.blocks_to_swap_in, runner.swap_in),
    ):
        if pairs:
            start = time.perf_counter()
            move(pairs)
            runner.synchronize()
            cost_model.observe_swap(time.perf_counter() - start, len(pairs))
    if out.blocks_to_copy:
        runner.copy_blocks(out.blocks_to_copy)


class KVCache:
    """The device KV pool, its host mirror for swapping, and the block moves between them.

    The pool (models/llama.py) holds every layer: layer ``l``'s block ``b`` is pool block
    ``l * num_blocks + b``, so a block move names that block in every layer. With a mesh the pool
    is split by kv heads; each process mirrors only its own devices' slices on the host.
    ``dtype`` is the pool's (pool_dtype): an 8-bit pool is ``(k, v, k_scales, v_scales)`` and
    every block move and the host mirror carry the scales with the pages.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        dtype,
        sharding,
    ):
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        self.sharding = sharding  # the pool's placement
        self.pages: tuple[jax.Array, ...] = init_kv_pool(
            config, num_blocks, block_size, dtype, sharding
        )
        # Swapped-out blocks, per slice of the kv heads held on this process's devices:
        # (first head, end head) -> one numpy array per pool array: (k, v) pages
        # [heads, num_layers, num_host_blocks, bs, hd], then an 8-bit pool's (k, v) scales
        # f32[heads, num_layers, num_host_blocks, bs].
        self.host_pool: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}

    def layer_ids(self, blocks: np.ndarray) -> np.ndarray:
        """Block ids (-1 = padding) -> the same blocks in every layer, layer-major."""
        layers = np.arange(self.config.num_layers, dtype=np.int32)[:, None] * self.num_blocks
        return np.where(blocks < 0, -1, layers + blocks[None, :]).reshape(-1).astype(np.int32)

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write: block src -> block dst in every layer (-1 pads both)."""
        self.pages = pallas_kernels.copy_blocks(
            self.pages, self.layer_ids(src), self.layer_ids(dst)
        )

    def swap_out(self, dev: np.ndarray, host: np.ndarray) -> None:
        """Device blocks -> host blocks, every layer (-1 pads ``dev``)."""
        if not self.num_host_blocks:
            raise ValueError("no host swap space: set swap_space_gib > 0 to swap")
        # Each process keeps its own devices' slices of the kv heads (the only ones it can read);
        # a slice held by several devices is kept once.
        blocks = pallas_kernels.gather_blocks(self.pages, self.layer_ids(dev))
        n = int((dev >= 0).sum())
        moves = {  # (pool array, head slice) -> device array [heads, num_layers * n_b, bs, ...]
            (kv, _heads(shard)): shard.data
            for kv, gathered in enumerate(blocks)
            for shard in gathered.addressable_shards
        }
        fetched = jax.device_get(list(moves.values()))  # all transfers at once
        for (kv, heads), data in zip(moves, fetched, strict=True):
            data = data.reshape(data.shape[0], self.config.num_layers, -1, *data.shape[2:])
            self.host_blocks(heads)[kv][:, :, host[:n]] = data[:, :, :n]

    def swap_in(self, host: np.ndarray, dev: np.ndarray) -> None:
        """Host blocks -> device blocks, every layer (-1 pads ``dev``)."""
        host = np.where(host < 0, 0, host)  # padding rows carry host block 0; dev -1 drops them

        def load(pages: jax.Array, kv: int) -> jax.Array:
            # This process's slices of the blocks, assembled into one array sharded like the pool.
            shards = []
            for s in pages.addressable_shards:
                blocks = self.host_blocks(_heads(s))[kv][:, :, host]  # [h, L, n_b, bs, ...]
                blocks = blocks.reshape(blocks.shape[0], -1, *blocks.shape[3:])
                shards.append(jax.device_put(blocks, s.device))
            shape = (pages.shape[0], self.config.num_layers * len(host), *pages.shape[2:])
            return jax.make_array_from_single_device_arrays(shape, pages.sharding, shards)

        blocks = tuple(load(pages, kv) for kv, pages in enumerate(self.pages))
        self.pages = pallas_kernels.scatter_blocks(self.pages, self.layer_ids(dev), blocks)

    def host_blocks(self, heads: tuple[int, int]) -> tuple[np.ndarray, ...]:
        """The host mirror of kv heads ``[heads[0], heads[1])``, one array per pool array,
        allocated on first use."""
        if heads not in self.host_pool:
            lead = (heads[1] - heads[0], self.config.num_layers, self.num_host_blocks)
            self.host_pool[heads] = tuple(
                np.zeros(lead + tuple(pages.shape[2:]), np.dtype(pages.dtype))
                for pages in self.pages
            )
        return self.host_pool[heads]

    def export_blocks(self, device_blocks, host_blocks) -> tuple[tuple | None, dict]:
        """Host copies of blocks' K/V (and an 8-bit pool's scales): (device, host).
        device: one array per pool array, [kv_heads, layers, len(device_blocks), bs, ...]
        (None when no block is asked); host: per slice of kv heads held here, one array per
        pool array, [heads, layers, len(host_blocks), bs, ...]."""
        device_blocks = np.asarray(device_blocks, np.int32)
        kv = None
        if len(device_blocks):
            ids = self.layer_ids(device_blocks)
            kv = tuple(
                np.asarray(jax.device_get(pages[:, ids])).reshape(
                    pages.shape[0], -1, len(device_blocks), *pages.shape[2:]
                )
                for pages in self.pages
            )
        host_ids = np.asarray(host_blocks, np.int64)
        host_kv = {
            heads: tuple(a[:, :, host_ids].copy() for a in arrays)
            for heads, arrays in self.host_pool.items()
        }
        return kv, host_kv

    def import_blocks(self, device_blocks, kv, host_blocks, host_kv: dict) -> None:
        """Write what ``export_blocks`` returned back into the same blocks."""
        if kv is not None:
            ids = self.layer_ids(np.asarray(device_blocks, np.int32))
            self.pages = tuple(
                jax.device_put(
                    pages.at[:, ids].set(data.reshape(data.shape[0], -1, *data.shape[3:])),
                    pages.sharding,
                )
                for pages, data in zip(self.pages, kv, strict=True)
            )
        host_ids = np.asarray(host_blocks, np.int64)
        for heads, saved in host_kv.items():
            for host, data in zip(self.host_blocks(heads), saved, strict=True):
                host[:, :, host_ids] = data

    def lower_block_op(self, op: str, ids: np.ndarray):
        """The program a block move of ``len(ids)`` blocks runs, lowered (for warm-up)."""
        layer_ids = self.layer_ids(ids)
        if op == "copy":
            return pallas_kernels.copy_blocks.lower(self.pages, layer_ids, layer_ids)
        if op == "gather":
            return pallas_kernels.gather_blocks.lower(self.pages, layer_ids)
        blocks = jax.eval_shape(pallas_kernels.gather_blocks, self.pages, layer_ids)
        blocks = jax.tree.map(
            lambda b, p: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=p.sharding),
            blocks,
            self.pages,
        )
        return pallas_kernels.scatter_blocks.lower(self.pages, layer_ids, blocks)

    def free(self) -> None:
        for pages in self.pages:
            pages.delete()
        self.pages = ()


def _heads(shard) -> tuple[int, int]:
    """The kv heads ``[start, end)`` that a shard of a pool-shaped array holds."""
    start = shard.index[0].start or 0
    return start, start + shard.data.shape[0]
