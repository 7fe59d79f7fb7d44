"""The runner's LoRA adapters: the device slots it holds (models/lora_slots.py), and their
loading as a device operation of the runner (replayed by a multi-process run's followers).

The step and forward programs take the slots last (worker/programs.py); each token row reads
its sequence's ``ScheduledSeq.lora_slot`` (0: the base model) through ``StepInput.lora_slot``.
A runner without a LoRA config holds none (``Runner.lora`` is None) and its programs are those of
an engine without LoRA. Writing a slot is one program for any adapter, compiled at warm-up
(``lower_write``): changing adapters compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from pagedjax.lora.config import LoRAConfig
from pagedjax.models.lora_slots import (
    LoRASlots,
    check_adapter_fits,
    init_slots,
    lower_set_slot,
    set_slot,
)


class RunnerLoRA:
    """The device slots of ``config``'s adapters (``slots``), in the runner's compute dtype,
    split as the projections are under a mesh, else placed where every program input is.
    ``call(op, *args)`` is the runner's door for a device operation (worker/device_calls.py):
    writing a slot goes through it, so that every process writes it."""

    def __init__(self, config: LoRAConfig, model_config, dtype, mesh, placement, call: Callable):
        slots = init_slots(model_config, config.max_loras, config.max_lora_rank, dtype, mesh)
        if mesh is None:
            slots = jax.device_put(slots, placement)
        self.slots: LoRASlots = slots
        self._call = call

    def load(self, slot: int, adapter) -> None:
        """Write ``adapter`` (models/lora.py's LoRAAdapter; None clears) into device slot
        ``slot``, in every process (the pool's steps read it from the next one on). An adapter
        the slots cannot hold (rank, or weights not finite in their dtype) is refused with a
        ValueError before any process writes anything."""
        check_adapter_fits(self.slots, adapter)
        self._call("load_lora", slot, adapter)

    def write(self, slot: int, adapter) -> None:
        """The device operation ``load`` runs (in every process)."""
        self.slots = set_slot(self.slots, slot, adapter)  # the old slots donated

    def lower_write(self):
        """The slot write's program, lowered for warm-up."""
        return lower_set_slot(self.slots)


def slots_of(lora: RunnerLoRA | None) -> LoRASlots | None:
    """What the programs take as their LoRA argument: the slots, or None without LoRA."""
    return None if lora is None else lora.slots


__all__ = ["RunnerLoRA", "slots_of"]
