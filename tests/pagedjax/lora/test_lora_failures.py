"""An adapter that cannot be (re)read fails its own requests alone: whatever the loader raises
becomes a ValueError naming the adapter, its path and the cause; a waiting request whose adapter
must be re-read at admission (it was removed, or evicted from the host cache) and cannot be
ends with finish "abort" and its error, while every other request runs on; a slot write that
fails leaves no slot held by nobody."""

from __future__ import annotations

import pytest
from lora_fakes import FakeLoRARunner, adapter, fake_loader, lora_engine

from pagedjax import SamplingParams
from pagedjax.lora import LoRAConfig, LoRAManager


class SafetensorError(Exception):
    """What safetensors raises for a truncated or garbage file: not a ValueError."""


class BreakableLoader:
    """fake_loader, except for the paths in ``broken``, whose reads raise SafetensorError."""

    def __init__(self):
        self.broken: set[str] = set()

    def __call__(self, path: str, model_config, max_rank: int):
        if path in self.broken:
            raise SafetensorError("Error while deserializing header: MetadataIncompleteBuffer")
        return fake_loader(path, model_config, max_rank)


def run(engine) -> dict:
    outs = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert not engine.has_unfinished_requests()
    return outs


LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("how", ["removed", "evicted"])
def test_a_waiting_request_whose_adapter_cannot_be_reread_fails_alone(how):
    """max_loras=1: b runs in the one slot; a request for a waits for it; a leaves the host
    cache (removed, or evicted by a third adapter's request: max_cpu_loras=1) and its file
    breaks. When the
    request is admitted the re-read fails: it ends alone; b's and the base model's requests
    (and c's) finish with all their tokens."""
    loader = BreakableLoader()
    engine = lora_engine(loader=loader, max_loras=1, max_cpu_loras=1)
    a, b, c = adapter(1), adapter(2), adapter(3)
    engine.add_request("b", [3, 4, 5], LONG, lora_request=b)
    engine.step()
    engine.add_request("a", [3, 4, 6], LONG, lora_request=a)
    engine.add_request("base", [3, 4, 7], LONG)
    if how == "removed":
        assert engine.remove_lora(a.lora_int_id)
    else:
        engine.add_request("c", [3, 4, 8], LONG, lora_request=c)  # max_cpu_loras=1: evicts a
        assert a.lora_int_id not in engine.list_loras()
    loader.broken.add(a.lora_path)
    outs = run(engine)
    failed = outs["a"]
    assert failed.outputs[0].finish_reason == "abort" and not failed.outputs[0].token_ids
    assert "adapter1" in failed.error and a.lora_path in failed.error
    assert "SafetensorError" in failed.error and "MetadataIncompleteBuffer" in failed.error
    for name in {"b", "base", "c"} & set(outs):
        assert outs[name].error is None and len(outs[name].outputs[0].token_ids) == 12
    assert engine.get_stats().num_blocks_used == 0
    # The adapter works again once its file does; nothing was left holding a slot.
    loader.broken.clear()
    engine.add_request("a again", [3, 4, 6], LONG, lora_request=a)
    assert run(engine)["a again"].error is None


def test_every_loader_failure_is_a_value_error_naming_adapter_path_and_cause():
    def loader(path, model_config, max_rank):
        raise OSError(5, "Input/output error")

    manager = LoRAManager(LoRAConfig(max_loras=1, max_lora_rank=8), loader=loader)
    with pytest.raises(ValueError, match=r"'adapter1' at '/adapters/1/rank4'.*OSError.*Input/out"):
        manager.add_lora(adapter(1))
    with pytest.raises(ValueError, match="'adapter1'.*OSError"):
        manager.read(adapter(1))
    assert manager.list_loras() == set() and manager.num_loads == 0


def test_a_failed_slot_write_frees_the_slot_and_the_request_fails_alone():
    class RefusingRunner(FakeLoRARunner):
        def load_lora_slot(self, slot, adapter):
            if adapter.path.endswith("rank8"):
                raise ValueError(f"LoRA adapter {adapter.path!r}: q_proj lora_A is not finite")
            super().load_lora_slot(slot, adapter)

    engine = lora_engine(runner=RefusingRunner, max_loras=1)
    engine.add_request("one", [3, 4, 5], LONG, lora_request=adapter(1))
    run(engine)
    engine.add_request("bad", [3, 4, 5], LONG, lora_request=adapter(2, rank=8))
    engine.add_request("base", [3, 4, 5], LONG)
    outs = run(engine)
    assert outs["bad"].outputs[0].finish_reason == "abort" and "not finite" in outs["bad"].error
    assert outs["base"].error is None
    # The slot that held adapter 1 was given up, not leaked: adapter 1 gets it back.
    assert engine.lora.manager.slot_of(1) is None
    engine.add_request("one again", [3, 4, 5], LONG, lora_request=adapter(1))
    assert run(engine)["one again"].error is None
    assert engine.lora.manager.slot_of(1) == 1
