"""LoRA through LLMEngine over the fake model (tests/support/fake_model.py): the options and their
errors, adapters added at add_request, admission with more adapters than slots, and the prefix
cache keyed by adapter."""

from __future__ import annotations

import dataclasses

import pytest
from fake_model import FakeRunner
from lora_fakes import adapter, lora_engine

from pagedjax import LoRARequest, SamplingParams
from pagedjax.config import EngineConfig
from pagedjax.engine.arg_utils import EngineArgs
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.lora import LoRAConfig


def run(engine: LLMEngine) -> dict:
    outs = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert not engine.has_unfinished_requests()
    return outs


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "field,value",
    [("max_loras", 0), ("max_lora_rank", 0), ("max_cpu_loras", 1), ("enable_lora", 1)],
)
@pytest.mark.parametrize("enable_lora", [True, False])
def test_lora_options_are_validated_naming_the_field(field, value, enable_lora):
    """The limits are one LoRAConfig, checked once (pagedjax/lora/config.py), whether or not
    LoRA is on; EngineArgs (LLM's keywords, the flags) refuses a bad one naming it."""
    options = {"enable_lora": enable_lora, "max_loras": 2} | {field: value}
    with pytest.raises(ValueError, match=field):
        EngineArgs(model="fake", **options)
    if field != "enable_lora":
        with pytest.raises(ValueError, match=field):
            LoRAConfig(**({"max_loras": 2} | {field: value}))


def test_the_engine_config_holds_one_lora_config():
    config = EngineArgs(
        model="fake", max_model_len=64, enable_lora=True, max_loras=3
    ).create_engine_config()
    assert config.lora == LoRAConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=None)
    assert (
        EngineArgs(model="fake", max_model_len=64, max_loras=3).create_engine_config().lora is None
    )
    with pytest.raises(ValueError, match="lora must be None or a LoRAConfig"):
        EngineConfig(model="fake", lora={"max_loras": 2})


def test_enable_lora_refuses_a_runner_without_adapter_slots():
    with pytest.raises(ValueError, match="LoRA needs the runner's adapter slots"):
        lora_engine(runner=FakeRunner)


def test_bad_lora_requests_are_refused_before_anything_is_queued():
    engine = lora_engine(max_lora_rank=8)
    cases = [
        (LoRARequest("nowhere", 1, "/adapters/none"), "/adapters/none"),
        (adapter(2, rank=16), "rank 16"),
        ("adapter2", "must be a LoRARequest"),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", [1, 2, 3], GREEDY, lora_request=lora)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.list_loras() == set()
    base = lora_engine(enable_lora=False)
    with pytest.raises(ValueError, match="enable_lora"):
        base.add_request("r", [1, 2, 3], GREEDY, lora_request=adapter(1))
    with pytest.raises(ValueError, match="enable_lora"):
        base.list_loras()
    assert not base.requests


def test_add_remove_list_pin():
    engine = lora_engine(max_cpu_loras=3)
    assert engine.add_lora(adapter(1)) and not engine.add_lora(adapter(1))
    engine.add_lora(adapter(2))
    assert engine.pin_lora(2)
    assert engine.list_loras() == {1, 2}
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    assert engine.list_loras() == {2}


def test_more_adapters_than_slots_all_finish_with_their_adapters_slots():
    engine = lora_engine(max_loras=2)
    runner = engine.runner
    for i in range(10):
        lora = None if i % 5 == 4 else adapter(1 + i % 5)
        engine.add_request(f"r{i}", [3 + i, 4, 5, 6, 7], GREEDY, lora_request=lora)
    outs = run(engine)
    assert sorted(outs) == sorted(f"r{i}" for i in range(10))
    assert all(len(o.outputs[0].token_ids) == 4 and o.error is None for o in outs.values())
    assert {path for _, path in runner.slot_loads} == {adapter(i).lora_path for i in (1, 2, 3, 4)}
    assert len(engine.list_loras()) == 2  # max_cpu_loras: max_loras by default


def test_a_prefix_block_is_never_reused_across_adapters_through_the_engine():
    engine = lora_engine()
    prompt = list(range(3, 3 + 25))  # three full blocks of 8 and a token

    def hits(name: str, lora) -> int:
        before = engine.get_stats().prefix_cache_hits
        engine.add_request(name, prompt, GREEDY, lora_request=lora)
        run(engine)
        return engine.get_stats().prefix_cache_hits - before

    assert hits("a1", adapter(1)) == 0
    assert hits("a2", adapter(2)) == 0  # same prompt, another adapter: nothing reused
    assert hits("base", None) == 0  # nor by the base model
    assert hits("a1 again", adapter(1)) == 3  # its own adapter's blocks are
    assert hits("base again", None) == 3


def test_an_id_names_one_adapter_for_the_engines_life():
    engine = lora_engine()
    engine.add_lora(adapter(1))
    engine.remove_lora(1)
    other = dataclasses.replace(adapter(1), lora_path="/adapters/other/rank4")
    with pytest.raises(ValueError, match="lora_int_id 1 names the adapter"):
        engine.add_request("r", [1, 2], GREEDY, lora_request=other)


def test_the_runner_gets_each_sequences_adapter_slot():
    engine = lora_engine(max_loras=2)
    engine.add_request("base", [1, 2, 3], GREEDY)
    engine.add_request("one", [1, 2, 3], GREEDY, lora_request=adapter(1))
    run(engine)
    loaded = dict(engine.runner.slot_loads)
    assert set(engine.runner.seen_slots) == {0, *loaded}
    assert loaded[engine.lora.manager.slot_of(1)] == adapter(1).lora_path


def test_generate_takes_one_lora_request_or_one_per_prompt():
    from pagedjax.entrypoints.llm import _per_prompt_loras

    one = adapter(1)
    assert _per_prompt_loras(one, 3) == [one] * 3
    assert _per_prompt_loras(None, 2) == [None, None]
    assert _per_prompt_loras([one, None], 2) == [one, None]
    with pytest.raises(ValueError, match="got 1 LoRARequests for 2 prompts"):
        _per_prompt_loras([one], 2)
    with pytest.raises(ValueError, match="lora_request must hold LoRARequests"):
        _per_prompt_loras(["adapter1"], 1)
