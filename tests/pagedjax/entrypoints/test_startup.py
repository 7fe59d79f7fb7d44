"""A server's start: a small set of programs before /health, the rest in the background, and
requests served meanwhile by compiling what they need on first use."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import types
import urllib.request

import jax
import jax.numpy as jnp
import pytest
from hf_models import tiny_llama_dir
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import param_shapes
from server_helpers import free_port, live_server, raw

from pagedjax import LLM, SamplingParams, compilation
from pagedjax.engine.hosting import startup
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.worker.input_batch import StepShape
from pagedjax.worker.runner import Runner, RunnerConfig
from pagedjax.worker.sampler import Filters, Variant
from pagedjax.worker.warmup import BackgroundCompile, compile_jobs
from pagedjax.worker.warmup_jobs import own_program_variant, plain_traffic

# The server's defaults for a model with an 8192-token context: 256 sequences, 8192 tokens.
DEFAULT_LIMITS = (256, 8192)


def _runner(max_model_len: int = 8192, block_size: int = 16) -> Runner:
    config = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 2, 1, 16)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), param_shapes(config))
    return Runner(
        config,
        params,
        RunnerConfig(num_blocks=8, block_size=block_size, max_model_len=max_model_len),
    )


def _names(jobs) -> list[str]:
    return [name for name, _ in jobs]


@pytest.mark.parametrize("query_buckets", [False, True], ids=["reference", "kernels"])
def test_a_dozen_model_programs_before_health_and_the_rest_in_the_background(query_buckets):
    runner = _runner()
    runner.batcher.query_buckets = query_buckets
    shapes = runner.step_shapes(*DEFAULT_LIMITS)
    first = _names(runner.startup_jobs(*DEFAULT_LIMITS))
    models = [n for n in first if n.startswith("model ")]
    assert 8 <= len(models) <= 16, models
    by_name = {f"model {s}": s for s in shapes}
    assert set(models) <= set(by_name)
    picked = [by_name[n] for n in models]
    # Decode of a few sequences at short contexts, and one fresh prompt of each common length.
    assert all(s.num_seqs <= 32 for s in picked)
    assert {s.num_tokens for s in picked if s.max_query_len == 1} == {8, 16, 32}
    assert {s.num_tokens for s in picked if s.max_query_len > 1} == {32, 64, 128, 256, 512}
    # Nothing rare: no penalties, masks, logprobs, speculation, block moves.
    rare = re.compile(r"penalt|constrain|logprob|score|verify|blocks")
    assert not [n for n in first if rare.search(n)]

    everything = _names(runner.warmup_jobs(*DEFAULT_LIMITS, swap=True))
    full = runner.warmup_jobs(*DEFAULT_LIMITS, swap=True)
    background = _names(startup._rarest_last(full, set(first)))
    assert len(background) == len(set(background))
    assert not set(background) & set(first)
    # Each program before /health is one of the full warm-up's, under its name there: the
    # background skips it rather than lowering it again under another name.
    assert set(first) <= set(everything), sorted(set(first) - set(everything))
    assert set(background) | set(first) >= set(everything)  # what the full warm-up compiled
    assert {f"model {s}" for s in shapes} <= set(background) | set(first)
    assert {"copy_blocks 8", "gather_blocks 8", "scatter_blocks 8"} <= set(background)
    assert any("penalties" in n for n in background)
    # First what plain requests run (model steps, default sampling), then the rare programs.
    plain = [plain_traffic(n) for n in background if not n.startswith("score")]
    assert plain == sorted(plain, reverse=True) and 0 < sum(plain) < len(plain)
    rare_kind = re.compile(r"penalt|constrain|logprob|score|verify|blocks")
    assert not [n for n in background[: sum(plain)] if rare_kind.search(n)]
    # The background starts where requests are likeliest: few sequences first.
    model_bg = [by_name[n] for n in background if n in by_name]
    assert model_bg[0].num_seqs <= 32 and model_bg[-1].num_seqs == 256
    # Last, the score programs of prompt logprobs: one per token bucket.
    scoring = [n for n in background if n.startswith("score")]
    assert background[-len(scoring) :] == scoring
    assert len(scoring) == len({s.num_tokens for s in shapes})


def test_the_program_set_is_bounded_and_small():
    """What makes programs: the model's work alone (token, sequence and width buckets, and on
    kernels that need it the longest query's); sampling, logprobs and prompt logprobs add a
    fixed few, never a multiple of the model's programs."""
    runner = _runner()
    shapes = runner.step_shapes(*DEFAULT_LIMITS)
    decode = [s for s in shapes if s.max_query_len == 1]
    jobs = _names(runner.warmup_jobs(*DEFAULT_LIMITS, swap=True))
    assert len({s.max_blocks for s in shapes}) == 1  # the kernels follow context lengths
    assert len(decode) == 6  # 8 .. 256 sequences
    steps = [n for n in jobs if n.startswith("step ")]
    assert len(steps) == 3 * len(decode)  # greedy with top logprobs, sampling, top-k / top-p
    samplers = [n for n in jobs if n.startswith("sampler ")]
    assert len(samplers) == 6 * len({s.num_seqs for s in shapes})
    assert len(jobs) == runner.program_bound(*DEFAULT_LIMITS, swap=True) <= 130
    assert len(jobs) == len(set(jobs))


def test_small_limits_keep_the_policy_within_the_shapes():
    runner = _runner(max_model_len=64, block_size=8)
    shapes = set(runner.step_shapes(4, 64))
    models = [n for n in _names(runner.startup_jobs(4, 64)) if n.startswith("model ")]
    assert models and {n[len("model ") :] for n in models} <= {str(s) for s in shapes}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_startup", tokenizer=True)


def test_a_request_needing_an_uncompiled_program_is_served_while_the_background_waits(tiny, caplog):
    # A max_model_len no other test uses: the penalties sampler (its history is max_model_len
    # wide) cannot have been compiled earlier in the same process.
    llm = LLM(tiny, block_size=8, max_model_len=88, num_blocks=48, max_num_seqs=4, seed=0)
    runner = llm.runner
    programs_before, counted_before = compilation.programs_compiled(), runner.num_compilations
    caplog.set_level(logging.INFO, logger="pagedjax.worker.runner")
    start = startup.prepare(llm.engine)
    assert start.report.num_compiled > 0 and start.background is not None
    assert runner.num_compilations - counted_before == start.report.num_compiled
    release = threading.Event()

    def blocked():  # holds the background compile until the request is served
        release.wait(120)
        return jax.jit(lambda x: x * 3).lower(jnp.float32(1))

    jobs = [("blocked", blocked), *start.background.jobs[:4]]
    start.background = BackgroundCompile(runner.compile, jobs)
    client = EngineLoop(llm.engine)
    client.attach_startup(start)
    app = build_app(client, "tiny")
    body = {
        "model": "tiny",
        "prompt": "w5 w6 w7 w5 w6",
        "max_tokens": 8,
        "temperature": 0,
        "frequency_penalty": 0.7,  # the penalties sampler: compiled on first use
        "presence_penalty": 0.3,
    }
    try:
        with live_server(app) as base:
            assert raw(base, "GET", "/health", key=None)[0] == 200
            compiled = runner.num_compilations
            status, reply = raw(base, "POST", "/v1/completions", body, key=None, timeout=300)
            assert status == 200, reply[:500]
            assert start.background.num_done == 0  # the background still waits
            assert runner.num_compilations > compiled  # the request compiled what it needed
            # ... and the log says which program every stream in flight waited for
            logged = [r.getMessage() for r in caplog.records if "on first use" in r.message]
            assert any("penalties" in m and m.startswith("run_step compiled") for m in logged)
            metrics = raw(base, "GET", "/metrics", key=None)[1].decode()
            assert re.search(r"^pagedjax_startup_seconds [1-9]", metrics, re.M), metrics[:2000]
            assert f"pagedjax_background_compile_pending {len(jobs)}.0" in metrics
            release.set()
            assert start.background.finished.wait(300)
            assert start.background.num_done == len(jobs)
            metrics = raw(base, "GET", "/metrics", key=None)[1].decode()
            assert "pagedjax_background_compile_pending 0.0" in metrics
    finally:
        release.set()
    text = json.loads(reply)["choices"][0]["text"]
    params = SamplingParams(
        max_tokens=8, temperature=0, frequency_penalty=0.7, presence_penalty=0.3
    )
    want = llm.generate(body["prompt"], params, use_tqdm=False)[0].outputs[0].text
    assert text == want
    # Every program compiled in this process meanwhile, on either thread, counted once.
    assert runner.num_compilations - counted_before == (
        compilation.programs_compiled() - programs_before
    )
    llm.close()


@pytest.mark.slow
def test_pagedjax_serve_answers_health_soon_with_empty_caches(tmp_path):
    """The embedded SmolLM2 GGUF, nothing compiled before: /health answers within a bound meant
    for a busy machine (the figure itself is a benchmark's), then a completion is served."""
    port = free_port()
    env = {**os.environ, "PAGEDJAX_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "pagedjax.cli", "serve", "--port", str(port)]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() - t0 < 600, "no /health within 600 s"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        model = json.loads(raw(base, "GET", "/v1/models", key=None)[1])["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8}
        status, reply = raw(base, "POST", "/v1/completions", body, key=None, timeout=300)
        assert status == 200, reply[:500]
        assert json.loads(reply)["choices"][0]["text"]
        metrics = raw(base, "GET", "/metrics", key=None)[1].decode()
        programs = re.search(r"^pagedjax_startup_programs (\S+)", metrics, re.M)
        assert programs and 0 < float(programs.group(1)) <= 60, metrics[:2000]
        assert re.search(r"^pagedjax_startup_seconds [1-9]", metrics, re.M), metrics[:2000]
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    assert list((tmp_path / "jax").iterdir())  # compiled programs went to the empty cache
    assert "programs compiled at start" in (tmp_path / "serve.log").read_text()  # the log line


def test_the_jax_and_xla_autotune_caches_live_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDJAX_COMPILATION_CACHE", raising=False)
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_enable_xla_caches")
    saved = {name: getattr(jax.config, name) for name in names}
    try:
        jax.config.update("jax_compilation_cache_dir", None)  # as in a fresh process
        jax.config.update("jax_persistent_cache_enable_xla_caches", None)  # whatever JAX's default
        assert compilation.enable_persistent_cache() == tmp_path / "jax"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax")
        # JAX puts the XLA caches it enables inside the compilation cache directory.
        assert "xla_gpu_per_fusion_autotune_cache_dir" in (
            jax.config.jax_persistent_cache_enable_xla_caches or ""
        )
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


def test_a_stopped_background_compile_starts_no_further_program():
    started, release, lowered = threading.Event(), threading.Event(), []

    def job(i):
        def lower():
            lowered.append(i)
            if i == 0:
                started.set()
                release.wait(60)
            return jax.jit(lambda x: x * (i + 7)).lower(jnp.float32(1))

        return (f"job {i}", lower)

    bg = BackgroundCompile(compile_jobs, [job(i) for i in range(3)])
    bg.start()
    assert started.wait(60)
    bg.stop(timeout=0)  # while the first job runs
    release.set()
    assert bg.finished.wait(60)
    assert lowered == [0] and bg.num_done == 1 and bg.num_compiled >= 1


def test_ready_moves_what_start_up_made_out_of_the_collectors_reach():
    """Objects alive when the server answers are frozen (gc.freeze), so that a full collection
    while serving does not walk the model's and the tokenizer's host-side objects."""
    import gc

    from pagedjax.worker.warmup import WarmupReport

    made = [[i] for i in range(2000)]
    frozen = gc.get_freeze_count()
    startup.Startup(WarmupReport(programs=[], seconds=0.0), None).ready()
    assert gc.get_freeze_count() >= frozen + len(made)
    young = {id(o) for o in gc.get_objects()}  # every generation but the permanent one
    assert not any(id(m) in young for m in made)


def test_what_the_background_compile_made_is_frozen_once_it_finishes():
    """The background compile's objects (jax's caches and executables) join the permanent
    generation when it is done, so that full collections while serving do not walk them; a
    stopped compile freezes nothing."""
    import gc

    made = []

    def job(i):
        def lower():
            made.extend([i] for _ in range(500))  # what compiling leaves alive
            return jax.jit(lambda x: x * (i + 11)).lower(jnp.float32(1))

        return (f"job {i}", lower)

    stopped = BackgroundCompile(compile_jobs, [job(0)], startup.freeze_compiled_objects)
    stopped.stop()
    stopped.start()
    assert stopped.finished.wait(60)
    assert not made and stopped.num_done == 0

    bg = BackgroundCompile(compile_jobs, [job(1), job(2)], startup.freeze_compiled_objects)
    bg.start()
    assert bg.finished.wait(120)
    young = {id(o) for o in gc.get_objects()}  # every generation but the permanent one
    assert len(made) == 1000 and not any(id(m) in young for m in made)


def test_metrics_count_a_background_compile_at_once_while_the_engine_is_idle(tiny):
    """/metrics reads the programs compiled when scraped: a background compile adds to them on
    its own thread while the idle engine thread publishes no new stats snapshot."""
    llm = LLM(tiny, block_size=8, max_model_len=64, num_blocks=16, max_num_seqs=2, seed=0)
    loop = EngineLoop(llm.engine, max_queue=4)  # not started: it publishes only once, here

    def counted() -> tuple[float, float]:
        text = loop.metrics.render().decode()
        names = ("compilations", "compile_seconds")
        found = [re.search(rf"^pagedjax_{name}_total (\S+)$", text, re.M) for name in names]
        return tuple(float(m.group(1)) for m in found)

    before = counted()
    assert before == (llm.runner.num_compilations, llm.runner.compile_seconds)
    bg = BackgroundCompile(
        llm.runner.compile, [("job", lambda: jax.jit(lambda x: x * 13).lower(jnp.float32(1)))]
    )
    bg.start()
    assert bg.finished.wait(120) and bg.num_compiled == 1
    after = counted()
    assert after[0] == before[0] + 1 and after[1] > before[1]
    llm.close()


def test_the_background_compiles_next_what_the_traffic_grows_into():
    """A step's shape makes the plain programs a bucket or two above it jump the queue (more
    sequences, tokens or context: what the same traffic meets next), nearest first; rare
    programs and far shapes keep the queue's order."""
    used: list[StepShape] = []
    prefer = startup.NearTraffic(used)
    names = [
        "sampler s8 penalties",
        "model decode t8 s8 b16",
        "model prefill q512 t512 s16 b32",
        "model decode t64 s64 b32",
        "step decode t64 s64 b32 sampler top_logprobs",  # rare: never jumps
        "model decode t32 s32 b32",
        "sampler s32 sampling candidates",  # the default rows' sampler, for any kind of step
        "model prefill q256 t256 s8 b16",
    ]
    jobs = [(n, None) for n in names]
    assert prefer(jobs) is None  # no step yet: the queue's order
    used.append(StepShape(16, 16, 32, 1))  # a decode step of 16 sequences
    order = []
    while (i := prefer(jobs)) is not None:
        order.append(jobs.pop(i)[0])
    assert order == [
        "model decode t32 s32 b32",
        "sampler s32 sampling candidates",
        "model decode t64 s64 b32",
    ]
    used.append(StepShape(128, 8, 16, 128))  # one prompt of up to 128 tokens
    assert jobs[prefer(jobs)][0] == "model prefill q256 t256 s8 b16"


def test_a_background_compile_follows_its_preference_and_survives_a_broken_one():
    compiled = []

    def job(i):
        def lower():
            compiled.append(i)
            return jax.jit(lambda x: x * (i + 17)).lower(jnp.float32(1))

        return (f"job {i}", lower)

    bg = BackgroundCompile(compile_jobs, [job(i) for i in range(4)], prefer=lambda jobs: -1)
    bg.start()
    assert bg.finished.wait(120)
    assert compiled == [3, 2, 1, 0] and bg.num_done == 4 and not bg.jobs

    def broken(jobs):
        raise RuntimeError("no choice")

    compiled.clear()
    bg = BackgroundCompile(compile_jobs, [job(i) for i in range(4, 7)], prefer=broken)
    bg.start()
    assert bg.finished.wait(120)
    assert compiled == [4, 5, 6] and bg.prefer is None  # the queue's order, after a log line


@pytest.mark.parametrize(
    "defaults, variant",
    [
        ({}, Variant(random=True)),  # temperature 1 alone
        (  # Qwen-like: a repetition penalty, top-p, top-k
            {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
            Variant(penalties=True, random=True, filters=Filters.SORT),
        ),
        ({"temperature": 0.0}, None),  # plain greedy: the step programs take its argmax
    ],
)
def test_the_programs_before_health_follow_the_models_sampling_defaults(defaults, variant):
    """A server whose model's generation config sets sampling defaults compiles the sampler of
    those defaults before /health, and counts it as plain traffic in the background."""
    engine = types.SimpleNamespace(
        default_sampling_params=defaults, model_config=types.SimpleNamespace(vocab_size=64)
    )
    assert startup.default_variant(engine) == variant
    runner = _runner()
    first = _names(runner.startup_jobs(*DEFAULT_LIMITS, default=variant))
    samplers = [n for n in first if not n.startswith("model ")]
    if variant is None:
        assert not samplers
        return
    own = own_program_variant(variant)  # a sampler program's (constrained columns)
    assert samplers and all(n.endswith((f" {variant}", f" {own}")) for n in samplers)
    assert all(plain_traffic(n, variant) for n in samplers)
    # each of them is one the full warm-up compiles, under the same name
    assert set(samplers) <= set(_names(runner.warmup_jobs(*DEFAULT_LIMITS, swap=True)))
    assert not any(plain_traffic(n) for n in samplers) or variant == Variant(random=True)
