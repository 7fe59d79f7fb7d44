"""LoRA in one engine, behind one object (vLLM's rule: the less common a feature, the fewer lines
it takes in common code). ``EngineLoRA`` holds the three parts and the engine holds it:

- the adapters' host cache and their device slots' assignment (``LoRAManager``, lora/manager.py);
- the scheduler's admission by slots (``LoRAAdmission``, core/lora_admission.py), which the
  scheduler takes in its constructor;
- the runner's device slots, which the runner holds (worker/lora.py's ``RunnerLoRA``) and the
  manager writes through ``load_slot``.

With LoRA off (``config`` None) there is no manager: the admission passes every request, and a
request or a call that names an adapter is refused with a ValueError saying how to turn LoRA on.

Pure Python; imports no jax.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedjax.core.lora_admission import LoRAAdmission
from pagedjax.lora.config import LoRAConfig
from pagedjax.lora.manager import Loader, LoRAManager
from pagedjax.lora.request import LoRARequest

__all__ = ["EngineLoRA", "LoRARequest", "lora_methods"]

OFF = "LoRA is off: enable_lora=True (--enable-lora) serves adapters"


class EngineLoRA:
    """``config``: the engine's LoRA limits (None: off; ``EngineLoRA()`` is LoRA off).
    ``runner``: the engine's (a ModelRunner, worker/runner_protocol.py), whose ``lora`` holds the
    device slots, each written with ``load(slot, adapter)``; a runner without them is refused
    when LoRA is on.
    ``loader(path, model_config, max_rank)`` reads an adapter (default: models/lora.py's)."""

    def __init__(
        self,
        config: LoRAConfig | None = None,
        runner=None,
        model_config=None,
        loader: Loader | None = None,
    ):
        self.config = config
        self.slots = None if runner is None else runner.lora  # the runner's device slots
        self.manager: LoRAManager | None = None
        if config is not None:
            if self.slots is None:
                raise ValueError(
                    "enable_lora=True: LoRA needs the runner's adapter slots, which "
                    f"{type(runner).__name__!r} does not have"
                )
            self.manager = LoRAManager(
                config, model_config=model_config, loader=loader, load_slot=self.slots.load
            )
        self.admission = LoRAAdmission(self.manager)

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def _manager(self) -> LoRAManager:
        if self.manager is None:
            raise ValueError(f"LoRA adapters need enable_lora=True ({OFF})")
        return self.manager

    def add_adapter_of(self, request: LoRARequest | None) -> None:
        """A request's adapter into the host cache as the request is added (None: the base
        model, nothing to do); a ValueError as ``add_lora``'s."""
        if request is not None:
            self.add_lora(request)

    # ---- vLLM's add_lora / remove_lora / list_loras / pin_lora -----------------------------

    def add_lora(self, request: LoRARequest) -> bool:
        """Load an adapter into the host cache now (a request's own is added with it); a bad
        path or a rank above max_lora_rank raises ValueError naming it."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {request!r:.200}")
        if self.manager is None:
            raise ValueError(f"lora_request {request.lora_name!r} given, but {OFF}")
        return self.manager.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache; requests in flight keep it until they finish
        (lora/manager.py)."""
        return self._manager().remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self._manager().list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._manager().pin_lora(lora_int_id)

    # ---- the server's: read off the engine thread, installed between steps ------------------

    def needs_read(self, request: LoRARequest | None) -> bool:
        """Whether ``request``'s adapter must be read from disk before its request is added
        (not in the host cache); False with LoRA off (the add then refuses it)."""
        return (
            request is not None
            and self.manager is not None
            and not self.manager.is_cached(request.lora_int_id)
        )

    def read(self, request: LoRARequest):
        """The adapter read and checked, touching nothing (any thread): lora/manager.py."""
        return self._manager().read(request)

    def install(self, request: LoRARequest, adapter) -> bool:
        """Put what ``read`` returned into the host cache (the engine's thread, between steps)."""
        return self._manager().install(request, adapter)

    # ---- what runs under which adapter ------------------------------------------------------

    @staticmethod
    def requests_info(scheduler) -> tuple[list[str], list[str]]:
        """The adapters of ``scheduler``'s running requests and of its waiting ones, by name,
        sorted (vLLM's lora_requests_info; the swapped count as waiting)."""

        def names(groups: Iterable) -> list[str]:
            return sorted({g.lora_request.lora_name for g in groups if g.lora_request})

        return names(scheduler.running), names([*scheduler.waiting, *scheduler.swapped])


def lora_methods() -> tuple:
    """vLLM's LLMEngine.add_lora, remove_lora, list_loras and pin_lora, each calling the
    engine's ``lora`` (an EngineLoRA): bound in the engine's class body."""

    def method(name: str):
        def call(self, *args):
            return getattr(self.lora, name)(*args)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = getattr(EngineLoRA, name).__doc__
        return call

    return tuple(method(name) for name in ("add_lora", "remove_lora", "list_loras", "pin_lora"))
