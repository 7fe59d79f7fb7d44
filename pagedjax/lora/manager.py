"""The host side of multi-LoRA serving: which adapters are loaded, and which device slot holds
which (vLLM's LRUCacheWorkerLoRAManager with the scheduler's max_loras count).

Pure Python; imports no jax. Two levels, each least recently used first:
- the host cache: up to ``max_cpu_loras`` loaded adapters (``add_lora`` loads one through the
  ``loader``; a request's adapter is added when the request is, before anything is queued);
- the device slots 1..max_loras (slot 0 = no adapter): ``activate`` puts an adapter into a slot
  when a request using it is admitted, calling ``load_slot(slot, adapter)`` (the runner's; it
  writes the slot's weights), and evicts only an adapter that no running request uses.

A pinned adapter (``pin_lora``) never leaves the host cache, and keeps a slot to itself: a batch
holds at most max_loras adapters counting the pinned ones (``fits``).

``remove_lora`` drops an adapter from the host cache at once; requests already in flight keep
it (as in vLLM): a running one keeps its slot until it finishes, a waiting one reloads the
adapter from its path when admitted. Nothing in flight is refused or lost.

Every failure to read an adapter is a ValueError naming it, its path and the cause (``read``),
whatever the loader raised: a request whose adapter cannot be (re)loaded at admission fails
alone (core/lora_admission.py). ``read`` touches none of the manager's state, so a server reads
and checks an adapter on another thread and ``install``s it between steps.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection

from pagedjax.lora.config import LoRAConfig
from pagedjax.lora.request import LoRARequest

NO_LORA = 0  # the base model's id and slot

# loader(path, model_config, max_rank) -> adapter (with .rank); raises ValueError naming what is
# wrong with the path or the adapter. load_slot(slot, adapter or None) writes a device slot.
Loader = Callable[[str, object, int], object]
LoadSlot = Callable[[int, object], None]


def _default_loader(path: str, model_config, max_rank: int):
    from pagedjax.models.lora import load_adapter  # jax: only where adapters really load

    return load_adapter(path, model_config, max_rank)


class LoRAManager:
    """``config``: the engine's limits (pagedjax/lora/config.py, checked there)."""

    def __init__(
        self,
        config: LoRAConfig,
        *,
        model_config=None,
        loader: Loader | None = None,
        load_slot: LoadSlot | None = None,
    ):
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self.max_cpu_loras = config.cpu_loras
        self.model_config = model_config
        self.loader = loader or _default_loader
        self.load_slot = load_slot
        # lora_int_id -> (request, adapter), least recently used first
        self._cache: collections.OrderedDict[int, tuple[LoRARequest, object]] = (
            collections.OrderedDict()
        )
        self._pinned: set[int] = set()
        self._slots: list[int] = [NO_LORA] * (self.max_loras + 1)  # slot -> lora_int_id (0: empty)
        self._slot_lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot
        self._paths: dict[int, str] = {}  # every id ever added: the one adapter it names
        self.num_loads = 0  # adapters read through the loader
        self.num_slot_loads = 0  # adapters written into a device slot

    # ---- vLLM's API ----------------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> bool:
        """Load the adapter into the host cache (a ValueError names a bad path or rank, or why
        the adapter cannot be read); False if it was cached already. Evicts the least recently
        used unpinned adapter if full. ``read`` then ``install`` do the same in two steps."""
        self._check_request(request)
        if request.lora_int_id in self._cache:
            self._cache.move_to_end(request.lora_int_id)
            return False
        self._check_room(request)
        return self.install(request, self.read(request))

    def is_cached(self, lora_int_id: int) -> bool:
        return lora_int_id in self._cache

    def read(self, request: LoRARequest):
        """The request's adapter read from its path and checked, not cached: it touches none
        of the manager's state, so it may run on another thread than the engine's. Every
        failure is a ValueError naming the adapter, its path and the cause."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {request!r:.200}")
        try:
            adapter = self.loader(request.lora_path, self.model_config, self.max_lora_rank)
        except ValueError:  # names the path and the cause (models/lora.py load_adapter)
            raise
        except Exception as e:  # a loader's own error: this adapter fails, nothing else
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} at {request.lora_path!r} cannot be read: "
                f"{type(e).__name__}: {e}"
            ) from e
        rank = getattr(adapter, "rank", None)
        if rank is not None and rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {request.lora_name!r} at {request.lora_path!r} has rank {rank}, above "
                f"max_lora_rank={self.max_lora_rank}"
            )
        return adapter

    def install(self, request: LoRARequest, adapter) -> bool:
        """Put an adapter ``read`` returned into the host cache; False if one of its id was
        cached already (the new copy is dropped). The same checks as ``add_lora``."""
        self._check_request(request)
        lid = request.lora_int_id
        if lid in self._cache:
            self._cache.move_to_end(lid)
            return False
        self._check_room(request)
        self.num_loads += 1
        while len(self._cache) >= self.max_cpu_loras:
            del self._cache[self._evictable_host()[0]]
        self._cache[lid] = (request, adapter)
        self._paths[lid] = request.lora_path
        return True

    def _check_request(self, request: LoRARequest) -> None:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {request!r:.200}")
        lid = request.lora_int_id
        known = self._paths.get(lid)
        if known is not None and known != request.lora_path:
            raise ValueError(
                f"lora_int_id {lid} names the adapter at {known!r}, not {request.lora_path!r}: "
                "an id names one adapter for the engine's life (cached KV blocks are keyed by it)"
            )

    def _check_room(self, request: LoRARequest) -> None:
        if len(self._cache) >= self.max_cpu_loras and not self._evictable_host():
            raise ValueError(
                f"cannot load adapter {request.lora_name!r}: all max_cpu_loras="
                f"{self.max_cpu_loras} cached adapters are pinned"
            )

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop the adapter from the host cache and unpin it; False if it was not there. Its
        device slot, if any, is the first to be reused once no running request needs it."""
        self._pinned.discard(lora_int_id)
        if lora_int_id in self._slot_lru:
            self._slot_lru.move_to_end(lora_int_id, last=False)
        return self._cache.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        """The ids of the adapters in the host cache."""
        return set(self._cache)

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep an added adapter in the host cache and in its own slot until removed."""
        if lora_int_id not in self._cache:
            raise ValueError(f"cannot pin lora_int_id {lora_int_id}: it is not loaded (add_lora)")
        if lora_int_id in self._pinned:
            return True
        if len(self._pinned) >= self.max_loras:
            raise ValueError(
                f"cannot pin lora_int_id {lora_int_id}: max_loras={self.max_loras} adapters are "
                "pinned already"
            )
        self._pinned.add(lora_int_id)
        return True

    def get(self, lora_int_id: int) -> LoRARequest | None:
        """The request an adapter in the host cache was added with."""
        entry = self._cache.get(lora_int_id)
        return None if entry is None else entry[0]

    # ---- admission (the scheduler's) -----------------------------------------------------------

    def servable(self, lora_int_id: int) -> bool:
        """Whether a request of this adapter can ever get a slot: not while every slot is
        pinned by other adapters."""
        return (
            lora_int_id == NO_LORA
            or lora_int_id in self._pinned
            or len(self._pinned) < self.max_loras
        )

    def fits(self, lora_int_id: int, active: Collection[int]) -> bool:
        """Whether a batch running the adapters ``active`` can take a request of this one:
        at most max_loras distinct adapters, the pinned ones counted."""
        if lora_int_id == NO_LORA or lora_int_id in active:
            return True
        return len({*active, *self._pinned, lora_int_id} - {NO_LORA}) <= self.max_loras

    def slot_of(self, lora_int_id: int) -> int | None:
        """The device slot holding this adapter (0 for the base model), None if in none."""
        if lora_int_id == NO_LORA:
            return NO_LORA
        return self._slot_lru.get(lora_int_id)

    def activate(self, request: LoRARequest | None, active: Collection[int]) -> int:
        """The device slot of the request's adapter, loading it into one first if needed (from
        the host cache, or from its path when it was evicted or removed). Only a slot that no
        adapter in ``active`` and no pinned adapter holds is reused; check ``fits`` first."""
        if request is None:
            return NO_LORA
        lid = request.lora_int_id
        slot = self._slot_lru.get(lid)
        if slot is not None:
            self._slot_lru.move_to_end(lid)
            return slot
        slot = self._free_slot(active)
        if slot is None:
            raise RuntimeError(
                f"no device slot for adapter {request.lora_name!r}: {self.max_loras} slots hold "
                f"adapters in use or pinned (admission must check fits first)"
            )
        self.add_lora(request)  # a no-op while cached; reloads an evicted or removed one
        adapter = self._cache[lid][1]
        old = self._slots[slot]
        if old != NO_LORA:
            del self._slot_lru[old]
        if self.load_slot is not None:
            try:
                self.load_slot(slot, adapter)
            except BaseException:  # what the slot holds is unknown now: nobody's
                self._slots[slot] = NO_LORA
                raise
        self.num_slot_loads += 1
        self._slots[slot] = lid
        self._slot_lru[lid] = slot
        return slot

    # ---- inside ---------------------------------------------------------------------------------

    def _evictable_host(self) -> list[int]:
        return [lid for lid in self._cache if lid not in self._pinned]

    def _free_slot(self, active: Collection[int]) -> int | None:
        """An empty slot, else the least recently used one that is neither active nor pinned."""
        for slot in range(1, self.max_loras + 1):
            if self._slots[slot] == NO_LORA:
                return slot
        for lid, slot in self._slot_lru.items():
            if lid not in active and lid not in self._pinned:
                return slot
        return None
