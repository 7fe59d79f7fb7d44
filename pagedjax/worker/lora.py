"""The runner's LoRA adapters: the device slots it holds (models/lora_slots.py), and their
loading as a device operation of the runner (replayed by a multi-process run's followers).

The step and forward programs take the slots last (worker/programs.py); each token row reads
its sequence's ``ScheduledSeq.lora_slot`` (0: the base model) through ``StepInput.lora_slot``.
Without a ``lora_config`` there are no slots and the programs are those of an engine without
LoRA. Writing a slot is one program for any adapter, compiled at warm-up
(``lower_slot_write``): changing adapters compiles nothing.
"""

from __future__ import annotations

import jax

from pagedjax.models.lora_slots import (
    LoRASlots,
    check_adapter_fits,
    init_slots,
    lower_set_slot,
    set_slot,
)


class LoRASlotsHolder:
    """Mixed into the Runner: ``lora_slots`` (None without LoRA) and ``load_lora_slot``."""

    lora_slots: LoRASlots | None = None

    def init_lora(self, lora_config, placement) -> None:
        """Hold ``lora_config``'s slots (a models/lora.py LoRAConfig), in the runner's compute
        dtype, split as the projections are under a mesh, else committed to ``placement`` as
        every program input is; the batcher then gives each step its rows' slots."""
        if lora_config is None:
            return
        slots = init_slots(self.config, lora_config, self.dtype, self.mesh)
        self.lora_slots = slots if self.mesh is not None else jax.device_put(slots, placement)
        self.batcher.lora = True

    def load_lora_slot(self, slot: int, adapter) -> None:
        """Write ``adapter`` (models/lora.py's LoRAAdapter; None clears) into device slot
        ``slot``, in every process (the pool's steps read it from the next one on). An adapter
        the slots cannot hold (rank, or weights not finite in their dtype) is refused with a
        ValueError before any process writes anything."""
        check_adapter_fits(self.lora_slots, adapter)
        self._call("load_lora", slot, adapter)

    def _load_lora(self, slot: int, adapter) -> None:
        self.lora_slots = set_slot(self.lora_slots, slot, adapter)  # the old slots donated

    def lower_slot_write(self):
        """The slot write's program, lowered for warm-up."""
        return lower_set_slot(self.lora_slots)


__all__ = ["LoRASlotsHolder"]
