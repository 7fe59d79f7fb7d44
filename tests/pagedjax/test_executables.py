"""Compiled programs within the kernel's memory-map limit, whatever the traffic: the guard drops
JAX's compiled programs past its share of the limit and the steps go on with the same results
(the programs they use come back from the persistent cache); a start-up warning names
vm.max_map_count when the program set alone would pass the share; the background compile stops
there."""

from __future__ import annotations

import gc
import logging

import jax
import jax.numpy as jnp
import pytest
from hf_models import tiny_llama_dir

from pagedjax import LLM, SamplingParams, compilation, executables
from pagedjax.worker.warmup import BackgroundCompile, compile_jobs


def test_the_process_counts_its_mappings():
    used, limit = executables.memory_maps()
    assert 0 < used < limit


def test_the_guard_drops_compiled_programs_past_its_share(monkeypatch):
    guard = executables.ExecutableGuard(share=0.5)
    double = jax.jit(lambda x: x * 2)
    double(jnp.float32(1))  # compiled: the guard has something new to look at
    monkeypatch.setattr(executables, "memory_maps", lambda: (400, 1000))
    assert not guard.check(force=True) and guard.num_evictions == 0
    monkeypatch.setattr(executables, "memory_maps", lambda: (600, 1000))
    assert not guard.check()  # nothing compiled since the last look: not even read
    before = compilation.programs_compiled()
    assert guard.check(force=True) and guard.num_evictions == 1 and guard.peak_maps == 600
    double(jnp.float32(1))  # dropped: it comes back (from the persistent cache)
    assert compilation.programs_compiled() > before
    with pytest.raises(ValueError, match="share"):
        executables.ExecutableGuard(share=1.5)


def test_a_start_warns_when_the_bound_alone_passes_the_share(monkeypatch, caplog):
    monkeypatch.setattr(executables, "memory_maps", lambda: (5000, 65530))
    caplog.set_level(logging.WARNING, logger="pagedjax.executables")
    assert not executables.warn_if_unsafe(119)  # 13,090 more of 65,530: within half
    assert executables.warn_if_unsafe(400)
    assert "vm.max_map_count (65530" in caplog.text and "400 programs" in caplog.text


def test_the_background_compile_stops_at_the_share(monkeypatch, caplog):
    guard = executables.ExecutableGuard()
    monkeypatch.setattr(guard, "over_share", lambda: True)
    lowered = []
    jobs = [(f"j{i}", lambda i=i: lowered.append(i)) for i in range(3)]
    caplog.set_level(logging.WARNING, logger="pagedjax.worker.warmup")
    bg = BackgroundCompile(compile_jobs, jobs, guard=guard)
    bg.start()
    assert bg.finished.wait(60)
    assert lowered == [] and "3 programs left" in caplog.text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_executables", tokenizer=True)


def test_steps_past_the_limit_drop_programs_and_give_the_same_tokens(tiny, monkeypatch):
    # A limit low enough that the mixed workload's programs pass its share several times over:
    # the guard drops them between steps, the steps reload what they use, the tokens are those
    # of a run under no limit.
    prompts = ["w1 w2", "w3 w4 w5 w6 w7 w8 w9", "w2 " * 11, "w5 w6 w7"]
    params = [
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=7, temperature=0.8, seed=3, n=2),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, presence_penalty=0.4),
        SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=1, prompt_logprobs=1),
    ]
    llm = LLM(tiny, block_size=8, max_model_len=96, num_blocks=64, max_num_seqs=8, seed=0)
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    guard = llm.runner.calls.guard
    jax.clear_caches()  # every program compiles (or loads) again under the limit
    gc.collect()
    # Half the limit lies below the mappings the process already holds, so every step that
    # compiles (or reloads) a program finds the guard past its share and it drops them all,
    # again and again. (A margin above the current count is not reached in a long process whose
    # freed mappings the reloaded programs reuse.)
    limit = 2 * (_real_maps() - 50)
    monkeypatch.setattr(executables, "memory_maps", lambda: (_real_maps(), limit))
    monkeypatch.setattr(executables, "CHECK_INTERVAL_S", 0.0)
    monkeypatch.setattr(guard, "peak_maps", 0)  # the process's guard: earlier tests' peaks
    monkeypatch.setattr(guard, "share", 0.5)  # the suite raises it (tests/conftest.py)
    evictions = guard.num_evictions
    for _ in range(2):
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        assert got == want
    assert guard.num_evictions > evictions
    # Past the share by at most what one step compiles (its step, sampler and score programs).
    assert guard.peak_maps <= limit // 2 + 4 * 150
    llm.close()


def _real_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
