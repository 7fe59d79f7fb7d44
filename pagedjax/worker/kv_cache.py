"""How many KV blocks the device pool and the host swap space hold (the pool's sizing)."""

from __future__ import annotations

import jax

from pagedjax.config import DEFAULT_CPU_KV_SPACE_GIB, CacheConfig


def num_device_blocks(cache: CacheConfig, block_bytes: int, tensor_parallel_size: int) -> int:
    """Blocks for a pool sized by kv_cache_space_gib; else by 90% of the free device memory
    (each device holds 1/tp of every block: its heads); else, on a CPU, by
    DEFAULT_CPU_KV_SPACE_GIB. (An explicit num_blocks needs none of this.)"""
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
