"""What a runner is sized for, in one frozen object (``Runner``'s third argument)."""

from __future__ import annotations

import dataclasses

from pagedjax.config import KV_CACHE_DTYPES
from pagedjax.lora.config import LoRAConfig


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """The KV pool: ``num_blocks`` device blocks of ``block_size`` tokens, ``num_host_blocks``
    host blocks for swapping, pages in ``kv_cache_dtype`` ("auto": the compute dtype; "int8" /
    "fp8": 8-bit pages with scales, worker/kv_cache.py). The engine's limits: ``max_model_len``
    tokens a sequence, ``max_num_seqs`` sequences a step (it sets the width of every step's
    device tokens, worker/step_program.py), ``num_speculative_tokens`` proposals a sequence may
    verify per step (each step then returns logits for 1 + that many rows per sequence and
    samples with ``verify_step``). ``lora``: the adapters' device slots (None: no LoRA,
    worker/lora.py)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    num_host_blocks: int = 0
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    num_speculative_tokens: int = 0
    lora: LoRAConfig | None = None

    @classmethod
    def of(
        cls, config, num_blocks: int, num_host_blocks: int, num_speculative_tokens: int = 0
    ) -> RunnerConfig:
        """An engine's (``config``: its EngineConfig), with the pool's sizes."""
        cache, sched = config.cache, config.scheduler
        return cls(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            max_model_len=sched.max_model_len,
            num_host_blocks=num_host_blocks,
            kv_cache_dtype=cache.kv_cache_dtype,
            max_num_seqs=sched.max_num_seqs,
            num_speculative_tokens=num_speculative_tokens,
            lora=config.lora,
        )

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_host_blocks", "num_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
