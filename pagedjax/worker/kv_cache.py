"""How many KV blocks the device pool and the host swap space hold (the pool's sizing)."""

from __future__ import annotations

import jax

from pagedjax.config import DEFAULT_CPU_KV_SPACE_GIB, CacheConfig
from pagedjax.models.llama import kv_pool_bytes_per_block


def bytes_per_block(device_config, block_size: int, dtype: str) -> int:
    """One block of every layer's K and V (all KV heads)."""
    return kv_pool_bytes_per_block(device_config, block_size, dtype)


def num_device_blocks(cache: CacheConfig, block_bytes: int, tensor_parallel_size: int) -> int:
    """num_blocks if set; else kv_cache_space_gib; else 90% of the free device memory (each
    device holds 1/tp of every block: its heads); else, on a CPU, DEFAULT_CPU_KV_SPACE_GIB."""
    if cache.num_blocks:
        return cache.num_blocks
    if cache.kv_cache_space_gib is not None:
        return int(cache.kv_cache_space_gib * 2**30 // block_bytes)
    device = jax.local_devices()[0]
    mem = device.memory_stats() if device.platform != "cpu" else None
    if mem and "bytes_limit" in mem:
        free = 0.9 * (mem["bytes_limit"] - mem.get("bytes_in_use", 0))
        return int(free // (block_bytes // tensor_parallel_size))
    return int(DEFAULT_CPU_KV_SPACE_GIB * 2**30 // block_bytes)


def num_host_blocks(cache: CacheConfig, block_bytes: int) -> int:
    return int(cache.swap_space_gib * 2**30 // block_bytes)
