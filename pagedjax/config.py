"""Engine configuration: frozen, validated dataclasses. A bad value raises ValueError naming it."""

from __future__ import annotations

import dataclasses

from pagedjax.generation_config import check_generation_config, default_sampling_params
from pagedjax.lora.config import LoRAConfig
from pagedjax.sampling_params import MAX_LOGPROBS
from pagedjax.spec_decode.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16")
# weight-only, a scale per output channel, or per 64 / 32 inputs of it (models/quant.py)
QUANTIZATIONS = ("int8", "fp8", "int8-g64", "int8-g32")
PREEMPTION_MODES = ("recompute", "swap", "auto")
# vLLM's --scheduling-policy: arrival order, or (priority, arrival) (pagedjax/core/request_queue.py)
SCHEDULING_POLICIES = ("fcfs", "priority")
# The KV pool's dtype: "auto" = the compute dtype; "int8" / "fp8" (float8_e4m3fn) pages with a
# float32 scale per token and kv head (pagedjax/worker/kv_cache.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
DEFAULT_CPU_KV_SPACE_GIB = 1.0
MAX_MODEL_LEN_CAP = 8192  # without an explicit max_model_len: the model's context, at most this


def resolve_max_model_len(max_model_len: int | None, model_context_len: int) -> int:
    """The engine's max_model_len: as given, else the model's context capped at
    MAX_MODEL_LEN_CAP (the one place this default is decided: LLM, the CLI and the server)."""
    return max_model_len or min(model_context_len, MAX_MODEL_LEN_CAP)


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_space_gib / device memory
    kv_cache_space_gib: float | None = None  # None: 1 GiB on CPU, else gpu_memory_utilization
    swap_space_gib: float = 4.0  # host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # On a GPU or TPU: the share of the device's memory (what JAX's allocator may hold) that
    # weights, KV pool and step workspace together may use; the pool takes what the weights leave
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        _require(
            isinstance(self.block_size, int) and self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            self.block_size,
            "must be one of 8, 16, 32, 64, 128",
        )
        _require(
            self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 2),
            "num_blocks",
            self.num_blocks,
            "must be None or an integer >= 2 (block 0 is reserved)",
        )
        _require(
            self.kv_cache_space_gib is None or self.kv_cache_space_gib > 0,
            "kv_cache_space_gib",
            self.kv_cache_space_gib,
            "must be None or > 0",
        )
        u = self.gpu_memory_utilization
        _require(
            isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1,
            "gpu_memory_utilization",
            u,
            "must be a number in (0, 1]",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"must be one of {KV_CACHE_DTYPES}",
        )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len without chunking
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap", or "auto" (cheaper of the two per group)
    policy: str = "fcfs"  # one of SCHEDULING_POLICIES (vLLM's SchedulerConfig.policy)

    def __post_init__(self):
        _require(
            self.policy in SCHEDULING_POLICIES,
            "policy",
            self.policy,
            f"must be one of {SCHEDULING_POLICIES}",
        )
        for name in ("max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name, value, "must be an integer >= 1")
        _require(
            self.max_num_batched_tokens is None
            or (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1),
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be None or >= 1",
        )
        _require(
            self.preemption_mode in PREEMPTION_MODES,
            "preemption_mode",
            self.preemption_mode,
            f"must be one of {PREEMPTION_MODES}",
        )

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or max(self.max_model_len, 2048)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    quantization: str | None = None  # None or one of QUANTIZATIONS
    seed: int = 0
    tensor_parallel_size: int = 1
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    # vLLM's dict ({"method": "ngram", "num_speculative_tokens": k, ...}) or SpeculativeConfig
    speculative_config: SpeculativeConfig | None = None
    # Schedule and dispatch step N+1 while step N runs (engine/step_loop.py), where it is safe
    async_scheduling: bool = True
    # Multi-LoRA serving (pagedjax/lora/): the limits on adapters; None: LoRA is off
    lora: LoRAConfig | None = None
    # Default sampling parameters (engine/generation_config.py): "auto" (the model's
    # generation_config.json), "vllm" (none) or a folder's; overrides by generation_config names
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's max_logprobs); at most
    # the sampler's top-logprobs width
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self):
        check_generation_config(self.generation_config, self.override_generation_config)
        k = self.max_logprobs
        _require(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS,
            "max_logprobs",
            k,
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        spec = SpeculativeConfig.of(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {DTYPES}")
        _require(
            self.quantization in (None, *QUANTIZATIONS),
            "quantization",
            self.quantization,
            f"must be None or one of {QUANTIZATIONS}",
        )
        _require(isinstance(self.seed, int), "seed", self.seed, "must be an integer")
        _require(
            isinstance(self.async_scheduling, bool),
            "async_scheduling",
            self.async_scheduling,
            "must be True or False",
        )
        _require(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            "must be an integer >= 1",
        )
        _require(
            self.lora is None or isinstance(self.lora, LoRAConfig),
            "lora",
            self.lora,
            "must be None or a LoRAConfig",
        )

    def sampling_defaults(self, model_dir: str) -> dict:
        """The SamplingParams fields a request gets unless it sets them: the model's
        generation config (in ``model_dir``) as ``generation_config`` says, with the overrides."""
        return default_sampling_params(
            self.generation_config, model_dir, self.override_generation_config
        )
