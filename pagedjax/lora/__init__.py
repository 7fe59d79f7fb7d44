"""Multi-LoRA serving, the host side: LoRARequest, the limits (LoRAConfig) and the adapter
manager (pure Python). The
adapters' weights and the batched LoRA matmul are in pagedjax.models.lora."""

from pagedjax.lora.config import LoRAConfig
from pagedjax.lora.manager import NO_LORA, LoRAManager
from pagedjax.lora.request import LoRARequest

__all__ = ["NO_LORA", "LoRAConfig", "LoRAManager", "LoRARequest"]
