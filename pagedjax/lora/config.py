"""The engine's limits on LoRA adapters, checked once, here (``EngineConfig.lora``; None: LoRA
is off). Pure Python: the scheduler's admission, the adapter manager and the runner's device
slots all read this one object."""

from __future__ import annotations

import dataclasses


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``max_loras``: adapters in one batch, each in a device slot (slot 0 is "no adapter", so
    the slot arrays hold max_loras + 1); ``max_lora_rank``: the largest rank an adapter may
    have; ``max_cpu_loras``: adapters kept loaded on the host (None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not _is_count(value):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and not (_is_count(cpu) and cpu >= self.max_loras):
            raise ValueError(
                f"max_cpu_loras must be None or an integer >= max_loras={self.max_loras}, "
                f"got {cpu!r}"
            )

    @property
    def cpu_loras(self) -> int:
        """Adapters the host cache holds."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
