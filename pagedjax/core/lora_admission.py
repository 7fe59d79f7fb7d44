"""Admission by LoRA adapter slots: the scheduler's collaborator (vLLM's max_loras check).

Pure Python; imports no jax. A batch never runs more distinct adapters than the device has slots
(``max_loras``, the pinned adapters counted: LoRAManager.fits). A waiting request whose adapter
would exceed that waits, and later requests that fit go ahead of it, as in vLLM. So that it is
not passed over forever by a steady stream of the adapters in the batch, once it has waited
``max_skips`` schedules later requests with an adapter wait too (base-model requests still go):
the adapters in the batch drain as their requests finish, and a slot frees for it.

The adapter enters a device slot (``activate``) when its request is admitted, on the host,
before the step that first runs it; ``assign_slots`` writes each scheduled chunk's slot
(``SeqChunk.lora_slot``, 0 = no adapter) for the runner.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedjax.core.sequence import SequenceGroup

MAX_SKIPS = 16


class LoRAAdmission:
    """``manager``: a pagedjax.lora.LoRAManager (None: LoRA is off and every check passes)."""

    def __init__(self, manager=None, max_skips: int = MAX_SKIPS):
        self.manager = manager
        self.max_skips = max_skips

    @staticmethod
    def active(running: Iterable[SequenceGroup]) -> set[int]:
        """The adapters the running groups use."""
        return {g.lora_int_id for g in running if g.lora_int_id}

    def should_wait(
        self, group: SequenceGroup, running: Iterable[SequenceGroup], skipped: list[SequenceGroup]
    ) -> bool:
        """Whether the group waits for an adapter slot (counted as a skip); ``skipped``: the
        groups ahead of it that wait so this step."""
        lid = group.lora_int_id
        if self.manager is None or not lid or not self.manager.servable(lid):
            return False  # an adapter that can never have a slot is refused by activate
        starving = any(g.num_lora_skips >= self.max_skips for g in skipped)
        if not starving and self.manager.fits(lid, self.active(running)):
            return False
        group.num_lora_skips += 1
        return True

    def activate(self, group: SequenceGroup, running: Iterable[SequenceGroup]) -> str | None:
        """Put the group's adapter in a device slot; why the group must be given up, if it must
        (its adapter cannot be loaded any more, or every slot is pinned by another)."""
        request = group.lora_request
        if self.manager is None or request is None:
            return None
        if not self.manager.servable(request.lora_int_id):
            return (
                f"every one of the max_loras={self.manager.max_loras} adapter slots is pinned by "
                f"another adapter than {request.lora_name!r}"
            )
        try:
            self.manager.activate(request, self.active(running))
        except ValueError as e:
            return f"its LoRA adapter {request.lora_name!r} could not be loaded: {e}"
        return None

    def assign_slots(self, chunks) -> None:
        """Each chunk's ``lora_slot``: the slot its group's adapter is in (0: none)."""
        if self.manager is None:
            return
        for c in chunks:
            slot = self.manager.slot_of(c.group.lora_int_id)
            if slot is None:
                raise RuntimeError(
                    f"request {c.group.request_id!r} is scheduled but its adapter "
                    f"{c.group.lora_int_id} holds no device slot"
                )
            c.lora_slot = slot
