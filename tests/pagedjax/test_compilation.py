"""Compile once: the bucket set covers every step the runner builds, warm-up compiles it so that a
mixed workload compiles nothing afterwards, and a second process loads its programs from the
persistent compilation cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import tiny_llama_dir
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import param_shapes

from pagedjax import LLM, BeamSearchParams, SamplingParams, compilation
from pagedjax.worker.runner import Runner, RunnerConfig, ScheduledSeq, StepShape
from pagedjax.worker.sampler import SamplingRow

ROOT = Path(__file__).resolve().parents[2]


def _runner(max_model_len: int, block_size: int) -> Runner:
    config = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 2, 1, 16)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), param_shapes(config))
    return Runner(
        config,
        params,
        RunnerConfig(num_blocks=8, block_size=block_size, max_model_len=max_model_len),
    )


def _shape(step) -> StepShape:
    t, s, b = len(step.token_ids), *step.block_tables.shape
    return StepShape(t, s, b, step.max_query_len)


@pytest.mark.parametrize("query_buckets", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize(
    "max_model_len, block_size, max_num_seqs, budget",
    [(2048, 16, 256, 2048), (96, 8, 12, 40), (300, 16, 5, 512)],
)
def test_bucket_set_covers_every_step_the_runner_builds(
    max_model_len, block_size, max_num_seqs, budget, query_buckets
):
    runner = _runner(max_model_len, block_size)
    runner.batcher.query_buckets = query_buckets  # kernels bucket the longest query
    shapes = runner.step_shapes(max_num_seqs, budget)
    assert len(set(shapes)) == len(shapes)
    rng = np.random.default_rng(max_model_len)

    def log_uniform(lo: int, hi: int) -> int:  # every bucket gets its share
        return min(hi, int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1)))))

    seen = set()
    for _ in range(3000):
        num_seqs = log_uniform(1, min(max_num_seqs, budget))
        decode = rng.random() < 0.3
        longest = 1 if decode else log_uniform(2, min(budget - num_seqs + 1, max_model_len - 1))
        seqs, tokens, rows = [], 0, 0
        for i in range(num_seqs):
            room = budget - tokens - (num_seqs - i - 1)
            q = longest if i == 0 else min(log_uniform(1, longest), room)
            start = log_uniform(1, max_model_len - q + 1) - 1
            table = list(range(1, -(-(start + q) // block_size) + 1))
            n = 1 if rng.random() < 0.9 else log_uniform(1, max_num_seqs)  # n > 1: more rows
            n = min(n, max_num_seqs - rows - (num_seqs - i - 1))
            rows += n
            tokens += q
            seqs.append(ScheduledSeq([1] * q, start, table, [SamplingRow()] * n))
        shape = _shape(runner.build_step_input(seqs))
        assert shape in shapes, f"{shape} built from {len(seqs)} seqs, {tokens} tokens"
        seen.add(shape)
    assert len(seen) > len(shapes) // 3  # and reach much of it: the set is not padded out


def test_the_reference_attention_needs_no_query_buckets():
    """Its work follows the real rows, so prefill programs take the token bucket as their bound:
    one program per (tokens, sequences, table width) instead of one per query bucket too."""
    runner = _runner(2048, 16)
    assert not runner.batcher.query_buckets  # CPU: the reference attention
    collapsed = runner.step_shapes(256, 2048)
    runner.batcher.query_buckets = True
    bucketed = runner.step_shapes(256, 2048)
    assert all(s.max_query_len in (1, s.num_tokens) for s in collapsed)
    assert len(collapsed) < len(bucketed) / 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_compile")


def test_after_warmup_nothing_compiles(tiny):
    llm = LLM(
        tiny,
        block_size=8,
        max_model_len=64,
        num_blocks=24,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space_gib=0.001,
        warmup=True,
    )
    warm = llm.get_stats()
    assert warm.num_compilations > 0 and warm.compile_seconds > 0
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(3, 250, n).tolist()  # noqa: E731
    # The first request with penalties and logprobs, after a warm-up that ran no request.
    first = SamplingParams(
        max_tokens=6, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=5, seed=1
    )
    out = llm.generate([prompt(20)], first, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6 and all(len(lp) >= 5 for lp in out.logprobs)
    assert llm.get_stats().num_compilations == warm.num_compilations
    # Prompt logprobs: steps that score prompt rows, whole and chunked beside other prompts.
    scored = SamplingParams(max_tokens=3, prompt_logprobs=2)
    scored_prompts = [np.random.default_rng(n).integers(3, 250, n).tolist() for n in (40, 7, 55)]
    outs = llm.generate(scored_prompts, scored, use_tqdm=False)
    assert [len(o.prompt_logprobs) for o in outs] == [40, 7, 55]
    assert llm.get_stats().num_compilations == warm.num_compilations
    # A mixed workload: prefill, chunked prefill (40 > 64 - decodes), decode, n > 1, sampling
    # options, logprobs, penalties, a shared prefix (copy-on-write), preemption by swapping.
    shared = prompt(13)
    prompts = [prompt(int(n)) for n in rng.integers(1, 45, 10)] + [shared + [5], shared + [6]]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 20)),
            temperature=float(rng.choice([0.0, 0.8])),
            top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 5])),
            n=int(rng.choice([1, 1, 2, 3])),
            logprobs=int(rng.choice([0, 2, 20])) if rng.random() < 0.5 else None,
            presence_penalty=float(rng.choice([0.0, 0.4])),
            ignore_eos=True,
        )
        for _ in prompts
    ]
    long = SamplingParams(max_tokens=25, ignore_eos=True)  # together they outgrow the pool
    prompts += [prompt(30) for _ in range(6)]
    params += [long] * 6
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    llm.beam_search([prompt(9), prompt(30)], BeamSearchParams(beam_width=3, max_tokens=5))
    stats = llm.get_stats()
    assert stats.num_swapped_out > 0 and stats.prefix_cache_hits > 0  # swap and sharing ran
    assert stats.num_compilations == warm.num_compilations, "a program compiled after warm-up"
    assert stats.compile_seconds == warm.compile_seconds
    llm.close()


@pytest.mark.slow
def test_the_embedded_model_warmed_up_compiles_nothing_for_a_mixed_workload():
    """The embedded SmolLM2 warmed up (its whole program set, within the bound) serves a mixed
    workload (odd prompt lengths, n = 3, beams, logprobs, prompt logprobs, penalties, stops, a
    grammar) compiling nothing more, its memory mappings within half the kernel's limit."""
    from pagedjax import executables
    from pagedjax.sampling_params import StructuredOutputsParams

    llm = LLM(max_model_len=512, num_blocks=40, warmup=True)
    warm = llm.get_stats()
    sched = llm.config.scheduler
    bound = llm.runner.program_bound(sched.max_num_seqs, sched.token_budget)
    assert 0 < warm.num_compilations <= bound
    words = [
        "the",
        "cache",
        "is",
        "paged",
        "in",
        "blocks",
        "of",
        "sixteen",
        "tokens",
        "like",
        "virtual",
        "memory",
    ]
    prompts = [" ".join(words[i % len(words)] for i in range(n)) for n in (3, 17, 41, 77, 5)]
    params = [
        SamplingParams(max_tokens=7, n=3, temperature=0.8, seed=1),
        SamplingParams(max_tokens=9, logprobs=5, prompt_logprobs=2),
        SamplingParams(max_tokens=11, repetition_penalty=1.3, presence_penalty=0.5, stop=["."]),
        SamplingParams(max_tokens=13, temperature=0.7, top_p=0.9, top_k=20, seed=2),
        SamplingParams(
            max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
        ),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs) and len(outs[0].outputs) == 3
    assert outs[4].outputs[0].text in ("yes", "no")
    llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=5))
    assert llm.get_stats().num_compilations == warm.num_compilations
    used, limit = executables.memory_maps()
    assert used < limit / 2
    llm.close()


_SECOND_PROCESS = textwrap.dedent(
    """
    import json, sys
    import jax
    from jax._src import monitoring
    sys.path[:0] = [sys.argv[2]]
    counts = {"hits": 0, "misses": 0}
    def on_event(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1
        if event == "/jax/compilation_cache/cache_misses":
            counts["misses"] += 1
    monitoring.register_event_listener(on_event)
    from pagedjax import LLM, SamplingParams
    llm = LLM(sys.argv[1], block_size=8, max_model_len=64, num_blocks=16, max_num_seqs=4)
    counts.update(hits=0, misses=0)  # the engine's own programs: those its steps need
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3), use_tqdm=False)
    print("COUNTS " + json.dumps({**counts, "compiled": llm.get_stats().num_compilations,
                                  "tokens": out[0].outputs[0].token_ids}))
    """
)


def test_a_second_process_loads_every_program_from_the_cache(tiny, tmp_path):
    env = {**os.environ, "PAGEDJAX_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", _SECOND_PROCESS, tiny, str(ROOT)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        line = next(x for x in result.stdout.splitlines() if x.startswith("COUNTS "))
        runs.append(json.loads(line[len("COUNTS ") :]))
    first, second = runs
    assert first["misses"] > 0 and first["compiled"] > 0
    assert second["misses"] == 0 and second["hits"] >= second["compiled"] > 0
    assert second["tokens"] == first["tokens"]
    assert list((tmp_path / "jax").iterdir())


def test_one_setting_turns_the_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    assert compilation.cache_dir() == tmp_path / "jax"
    monkeypatch.setenv("PAGEDJAX_COMPILATION_CACHE", "0")
    assert compilation.cache_dir() is None
