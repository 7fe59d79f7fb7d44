"""The runner's LoRA programs: an engine without adapters lowers the step program it lowered
before LoRA existed (the StepInput's ``lora_slot`` None takes no words, the slots no arguments);
one with adapters takes the slots as arguments; a slot load is a device operation that a
multi-process run's followers replay (the adapter travels pickled, as the channel sends it)."""

from __future__ import annotations

import pickle

import jax
import numpy as np
import pytest
from hf_models import make_tiny_model
from pagedjax.models.loader import load_model
from pagedjax.models.lora import load_adapter

from pagedjax.bench.throughput_lora import random_adapters
from pagedjax.lora import LoRAConfig
from pagedjax.worker import programs, step_program, warmup_jobs
from pagedjax.worker.runner import Runner, RunnerConfig

LORA = LoRAConfig(max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_programs")
    make_tiny_model("llama_gqa", root / "base")
    loaded = load_model(str(root / "base"), "float32", use_cache=False)
    (request,) = random_adapters(loaded.config, 1, 8, root / "adapters")
    return loaded, load_adapter(request.lora_path, loaded.config, 8)


def runner(loaded, lora_config=None, channel=None) -> Runner:
    sizes = RunnerConfig(
        num_blocks=16, block_size=8, max_model_len=32, max_num_seqs=4, lora=lora_config
    )
    return Runner(loaded.config, loaded.params, sizes, channel=channel)


def test_without_lora_the_step_program_is_the_one_before(tiny):
    loaded, _ = tiny
    plain, lora = runner(loaded), runner(loaded, LORA)
    for shape in plain.compiler.step_shapes(4, 32)[:2]:  # a decode shape and a prefill one
        empty = plain.batcher.empty(shape)
        assert empty.lora_slot is None
        rows = np.zeros(len(empty.logits_indices), np.int32)
        packed, layout = step_program.pack_inputs(empty, rows)
        words = sum(np.size(getattr(empty, f)) for f in step_program.ARRAY_FIELDS[:-1])
        assert packed.size == words + rows.size and layout.shapes[-1] is None
        args = (plain.params, plain.kv_cache.pages, packed, plain.place(np.zeros(8, np.int32)))
        args += (plain.statics, layout)
        before = programs.step.lower(*args)  # the call as it was: no slots argument
        now = warmup_jobs.lower_step(plain, shape)
        assert now.as_text() == before.as_text()
        with_lora = warmup_jobs.lower_step(lora, shape)
        extra = len(jax.tree.leaves(lora.lora.slots))
        assert extra == 2 * 7  # a and b of every projection
        num_args = lambda lowered: len(jax.tree.leaves(lowered.args_info))  # noqa: E731
        assert num_args(with_lora) == num_args(now) + extra


class Recorder:
    """A driver's channel: keeps each message as the followers would receive it."""

    is_driver = True

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(pickle.loads(pickle.dumps(message)))


class Replay:
    """A follower's channel: the driver's messages, then "stop"."""

    is_driver = False

    def __init__(self, messages):
        self.messages = [*messages, ("stop", None)]

    def recv(self):
        return self.messages.pop(0)


def test_followers_replay_slot_loads(tiny):
    loaded, adapter = tiny
    channel = Recorder()
    driver = runner(loaded, LORA, channel)
    driver.lora.load(2, adapter)
    driver.lora.load(1, adapter)
    driver.lora.load(2, None)
    assert [op for op, _ in channel.sent] == ["load_lora"] * 3
    follower = runner(loaded, LORA, Replay(channel.sent))
    assert follower.follow() == ("stop", None)
    for mine, theirs in zip(
        jax.tree.leaves(driver.lora.slots), jax.tree.leaves(follower.lora.slots), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    assert np.asarray(follower.lora.slots.a["q_proj"][:, 1]).any()
    assert not np.asarray(follower.lora.slots.a["q_proj"][:, 2]).any()
