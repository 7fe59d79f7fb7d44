"""LoRARequest: which adapter a request runs under (vLLM's ``vllm.lora.request.LoRARequest``).

Pure Python. ``lora_int_id`` names one adapter for the engine's whole life: the prefix cache keys
computed KV blocks by it, so an id is never reused for another adapter (the engine refuses that).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the name clients use (the server's ``model`` field)
    lora_int_id: int  # >= 1; 0 is the base model (no adapter)
    lora_path: str  # a PEFT adapter directory (adapter_config.json + weights)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
