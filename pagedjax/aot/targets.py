"""The machines a deviceless compile targets: a TPU generation and chip count, or an NVIDIA GPU,
and the compile-only devices JAX makes for them on a machine without one.

TPU targets need libtpu (jax's ``[tpu]`` extra), GPU targets the CUDA 12 plugin (``[cuda]``);
neither needs the accelerator. What a target's compiler says (errors, memory, the optimized HLO)
is the hardware's own; nothing runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import numpy as np

GIB = 2**30

# sm_90 as XLA's GPU compiler sees it (stream_executor's GpuTargetConfigProto, text form): the
# SM count, shared memory per SM and per block (opt-in), L2 and memory size of the named card.
_GPU_CONFIG = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
runtime_version {{ major: 12 minor: 9 }}
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{name}"
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """One machine: ``platform`` "tpu" or "cuda", ``chips`` devices (a tensor-parallel mesh over
    all of them), each with ``hbm_bytes`` of memory; ``topology`` is libtpu's name for the slice
    (TPU) and ``gpu_config`` XLA's description of the card (GPU)."""

    name: str
    platform: str
    chips: int
    hbm_bytes: int
    description: str
    topology: str = ""
    host_bounds: tuple[int, int, int] = (1, 1, 1)
    gpu_config: str = ""
    # The share of a device's memory JAX's allocator may hold: on a GPU its default
    # XLA_PYTHON_CLIENT_MEM_FRACTION (0.75), on a TPU all of it.
    allocator_fraction: float = 1.0

    @property
    def allocator_bytes(self) -> int:
        """What the engine's memory budget (gpu_memory_utilization) is a share of, per device."""
        return int(self.hbm_bytes * self.allocator_fraction)

    @property
    def plugin(self) -> str:
        """The package the target's compiler comes in."""
        return "libtpu" if self.platform == "tpu" else "jax_cuda12_plugin"

    def available(self) -> bool:
        """Whether this machine has the target's compiler installed."""
        return importlib.util.find_spec(self.plugin) is not None

    def devices(self) -> list:
        """The target's compile-only devices (ValueError naming the missing package)."""
        if not self.available():
            extra = "tpu" if self.platform == "tpu" else "cuda"
            raise ValueError(
                f"target {self.name!r} needs {self.plugin} (pip install 'pagedjax[{extra}]'); "
                "it is not installed"
            )
        return list(_devices(self))


def _tpu(name, topology, chips, hbm_gib, kind, bounds=(1, 1, 1)) -> Target:
    return Target(name, "tpu", chips, hbm_gib * GIB, kind, topology, bounds)


def _gpu(name, memory, bandwidth, l2, description) -> Target:
    config = _GPU_CONFIG.format(memory=memory, bandwidth=bandwidth, l2=l2, name=description)
    return Target(name, "cuda", 1, memory, description, gpu_config=config, allocator_fraction=0.75)


TARGETS = {
    t.name: t
    for t in (
        _tpu("v5e-1", "v5e:1x1", 1, 16, "TPU v5 lite"),
        _tpu("v5e-4", "v5e:2x2", 4, 16, "TPU v5 lite", (2, 2, 1)),
        _tpu("v5e-8", "v5e:2x4", 8, 16, "TPU v5 lite", (2, 2, 1)),
        _tpu("v6e-1", "v6e:1x1", 1, 32, "TPU v6 lite"),
        _tpu("v6e-4", "v6e:2x2", 4, 32, "TPU v6 lite", (2, 2, 1)),
        _tpu("v6e-8", "v6e:2x4", 8, 32, "TPU v6 lite", (2, 2, 1)),
        _tpu("v5p-8", "v5p:2x2x1", 4, 95, "TPU v5", (2, 2, 1)),
        _gpu("h100", 85520809984, 3352320000000, 52428800, "NVIDIA H100 80GB HBM3"),
        _gpu("h200", 150754820096, 4800000000000, 62914560, "NVIDIA H200"),
    )
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {sorted(TARGETS)}")
    return TARGETS[name]


@functools.cache
def _devices(target: Target) -> tuple:
    from jax.experimental import topologies

    if target.platform == "tpu":
        # libtpu takes /tmp/libtpu_lockfile so that one process drives a machine's TPUs; a
        # compile-only topology drives none, and two compiles may run side by side.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topology = topologies.get_topology_desc(
            platform="tpu",
            topology_name=target.topology,
            chip_config_name="default",
            chips_per_host_bounds=target.host_bounds,
            num_slices=1,
            wrap=(False, False, False),
        )
    else:
        topology = topologies.get_topology_desc(
            target.name, "cuda", target_config=target.gpu_config, topology="1x1x1"
        )
    devices = tuple(topology.devices)
    if len(devices) != target.chips:
        raise ValueError(f"target {target.name!r}: {len(devices)} devices, {target.chips} expected")
    return devices


def device_grid(target: Target) -> np.ndarray:
    """The target's devices as the one-axis array a tensor-parallel mesh is made of."""
    return np.asarray(target.devices())
