"""LoRAManager as plain Python: the host cache (LRU, pinning), device slots (LRU among adapters
no running request uses), the load_slot callback, and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedjax import LoRARequest
from pagedjax.lora import LoRAConfig, LoRAManager


class FakeLoader:
    """load_adapter's stand-in: a path "rank<r>" loads an adapter of rank r; "missing" fails."""

    def __init__(self):
        self.loaded: list[str] = []

    def __call__(self, path: str, model_config, max_rank: int):
        if "missing" in path:
            raise ValueError(f"no adapter_config.json in {path!r}")
        self.loaded.append(path)
        return SimpleNamespace(rank=int(path.rsplit("rank", 1)[1]), path=path)


def req(i: int, rank: int = 8) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}/rank{rank}")


def manager(max_loras=2, max_cpu_loras=None, max_lora_rank=16):
    slots = []
    m = LoRAManager(
        LoRAConfig(max_loras, max_lora_rank, max_cpu_loras),
        loader=FakeLoader(),
        load_slot=lambda slot, adapter: slots.append((slot, adapter.path)),
    )
    return m, slots


def test_lora_request_validates_its_fields():
    assert LoRARequest("x", 1, "/p").adapter_id == 1
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", True, "/p")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1, "")
    with pytest.raises(AttributeError):
        LoRARequest("x", 1, "/p").lora_int_id = 2  # frozen


def test_host_cache_is_lru_and_loads_once():
    m, _ = manager(max_loras=1, max_cpu_loras=2)
    assert m.add_lora(req(1)) and m.add_lora(req(2))
    assert not m.add_lora(req(1))  # cached: touched, not reloaded
    assert m.add_lora(req(3))  # evicts 2, the least recently used
    assert m.list_loras() == {1, 3}
    assert m.loader.loaded == [req(1).lora_path, req(2).lora_path, req(3).lora_path]


def test_bad_path_and_rank_are_value_errors_naming_them():
    m, _ = manager(max_lora_rank=8)
    with pytest.raises(ValueError, match="missing"):
        m.add_lora(LoRARequest("bad", 1, "/missing/rank8"))
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        m.add_lora(req(2, rank=16))
    assert m.list_loras() == set()


def test_an_id_names_one_adapter_for_life():
    m, _ = manager()
    m.add_lora(req(1))
    m.remove_lora(1)
    with pytest.raises(ValueError, match="lora_int_id 1 names the adapter"):
        m.add_lora(LoRARequest("other", 1, "/adapters/other/rank4"))


def test_slots_are_lru_among_adapters_not_in_use():
    m, slots = manager(max_loras=2)
    assert m.activate(req(1), active=set()) == 1
    assert m.activate(req(2), active={1}) == 2
    assert m.activate(req(1), active={1, 2}) == 1  # already in: no load
    assert slots == [(1, req(1).lora_path), (2, req(2).lora_path)]
    # 3 comes while 2 runs: 1 is the one not in use, though 2 was used less recently
    assert m.activate(req(3), active={2}) == 1
    assert m.slot_of(1) is None and m.slot_of(3) == 1 and m.slot_of(0) == 0
    assert m.activate(req(4), active=set()) == 2  # now 2 is the least recently used
    with pytest.raises(RuntimeError, match="no device slot"):
        m.activate(req(5), active={3, 4})


def test_fits_counts_distinct_adapters_and_pinned_ones():
    m, _ = manager(max_loras=2)
    assert m.fits(1, set()) and m.fits(2, {1}) and not m.fits(3, {1, 2})
    assert m.fits(1, {1, 2}) and m.fits(0, {1, 2})  # in the batch already; the base model
    m.add_lora(req(9))
    m.pin_lora(9)
    assert not m.fits(2, {1}) and m.fits(9, {1})  # 9 keeps a slot to itself


def test_pinned_adapters_stay_in_cache_and_slot():
    m, slots = manager(max_loras=2, max_cpu_loras=2)
    m.add_lora(req(1))
    m.pin_lora(1)
    m.add_lora(req(2))
    m.add_lora(req(3))  # evicts 2, not the pinned 1
    assert m.list_loras() == {1, 3}
    assert m.activate(req(1), active=set()) == 1
    assert m.activate(req(3), active=set()) == 2
    assert m.activate(req(4), active=set()) == 2  # 1 is pinned: its slot is never reused
    assert m.list_loras() == {1, 4}
    m.pin_lora(4)
    assert not m.servable(5) and m.servable(1)  # every slot pinned by another adapter
    with pytest.raises(ValueError, match="pinned"):
        m.add_lora(req(6))  # the host cache holds only pinned adapters
    with pytest.raises(ValueError, match="not loaded"):
        m.pin_lora(7)


def test_pinning_more_adapters_than_slots_is_refused():
    m, _ = manager(max_loras=1, max_cpu_loras=3)
    m.add_lora(req(1))
    m.add_lora(req(2))
    assert m.pin_lora(1) and m.pin_lora(1)
    with pytest.raises(ValueError, match="max_loras=1 adapters are pinned"):
        m.pin_lora(2)
    assert m.remove_lora(1)  # unpins it
    assert m.pin_lora(2)


def test_remove_keeps_requests_in_flight_whole():
    m, slots = manager(max_loras=1, max_cpu_loras=1)
    m.add_lora(req(1))
    assert m.activate(req(1), active=set()) == 1
    assert m.remove_lora(1) and not m.remove_lora(1)
    assert m.list_loras() == set()
    # a running request keeps its slot: another adapter cannot take it while 1 is in use
    assert m.slot_of(1) == 1 and not m.fits(2, {1})
    with pytest.raises(RuntimeError):
        m.activate(req(2), active={1})
    # a waiting request of the removed adapter reloads it from its path when admitted
    m.activate(req(2), active=set())
    assert m.activate(req(1), active=set()) == 1
    assert m.loader.loaded.count(req(1).lora_path) == 2


def test_config_limits_are_checked():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        manager(max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_loras"):
        manager(max_loras=0)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1, got True"):
        LoRAConfig(max_lora_rank=True)
