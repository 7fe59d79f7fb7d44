"""The engine's step programs (the warm-up's largest decode and prefill steps, worker/
warmup_jobs.py) compiled for v5e, v6e and H100 without one, at the engine's default pool size
(90% of a device's memory less the weights): SmolLM2 at its 30 layers and Llama-3-8B's shapes
(2 of its 32 layers; over 8 v5e chips tensor parallel), float and 8-bit pools. Each compiles,
fits, and its optimized HLO holds no copy of the KV pool, no copy or slice of a weight, no
conditional and no while loop, with temporaries under one layer's share of the pool.

On main before these checks, XLA:TPU copied every layer's pool into its scatter's layout and
back (64 whole-pool copies per SmolLM2 decode step, 4.9 GiB of temporaries for a 0.7 GiB pool),
every 8-bit kernel failed to compile, and jnp.searchsorted left 60 while loops in a prefill
step. The H100's unrolled layers read their weights in place; under the scan (the CPU's loop)
XLA:GPU slices each layer's weights into new buffers, which the report sees."""

from __future__ import annotations

import functools

import pytest
from aot_cases import model_config, target_or_skip
from pagedjax.pallas_kernels import AttentionBackend, TpuBackend

from pagedjax.aot.compile import compile_jobs, select_jobs
from pagedjax.aot.target_runner import TargetRunner
from pagedjax.config import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.slow
MODELS = {"smollm2_135m": (None, 2048), "llama3_8b": (2, 4096)}  # (layers kept, max_model_len)


def engine(max_model_len: int, kv_cache_dtype="auto", tp=1, pool_gib=None) -> EngineConfig:
    """bfloat16, 256 sequences; the pool from memory, or of ``pool_gib``."""
    return EngineConfig(
        model="config.json",
        dtype="bfloat16",
        tensor_parallel_size=tp,
        cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_space_gib=pool_gib),
        scheduler=SchedulerConfig(max_num_seqs=256, max_model_len=max_model_len),
    )


def compile_steps(
    model: str, target: str, kv_cache_dtype="auto", tp=1, layer_loop=None, only=None, pool_gib=None
):
    """(runner, reports) of the largest decode and prefill steps (``only``: those matching)."""
    layers, max_model_len = MODELS[model]
    settings = engine(max_model_len, kv_cache_dtype, tp, pool_gib)
    runner = TargetRunner(model_config(model, layers), settings, target_or_skip(target), layer_loop)
    jobs = select_jobs(runner, "largest", 256, settings.scheduler.token_budget, only)
    return runner, compile_jobs(runner, jobs)


compiled = functools.cache(compile_steps)  # shared by the tests that read the same programs


def assert_clean(runner, reports):
    assert [r.name.split()[1] for r in reports] == ["decode", "prefill"]
    layer_share = runner.pool_bytes / runner.config.num_layers
    for r in reports:
        assert r.error is None, r.error
        assert r.failures(runner.target.allocator_bytes) == [], (r.name, r.findings.examples)
        assert r.findings.while_loops == 0, r.name
        assert r.memory.donated >= runner.pool_bytes, "the pool is donated"
        assert r.memory.temporaries < layer_share, (r.name, r.memory, layer_share)


@pytest.mark.parametrize("target", ["v5e-1", "v6e-1", "h100"])
def test_smollm2_steps_at_30_layers(target):
    runner, reports = compiled("smollm2_135m", target)
    assert runner.config.num_layers == 30 and runner.layer_loop == "unrolled"
    assert runner.pool_bytes > 0.6 * runner.target.allocator_bytes  # the default pool size
    assert_clean(runner, reports)


@pytest.mark.parametrize("target", ["v5e-1", "v6e-1", "h100"])
def test_llama3_8b_shaped_steps(target):
    assert_clean(*compiled("llama3_8b", target))


@pytest.mark.parametrize("target", ["v5e-1", "v6e-1"])
def test_8bit_pool_steps(target):
    """int8 pages with their scales: the kernels compile, and the scales (rows padded to 128
    lanes, a multiple of 8 of them) are written and read in place like the pages."""
    runner, reports = compiled("llama3_8b", target, "int8")
    assert [p.dtype.name for p in runner.kv_cache.pages] == ["int8"] * 2 + ["float32"] * 2
    assert_clean(runner, reports)


def test_llama3_8b_shaped_steps_tensor_parallel_over_8_v5e_chips():
    runner, reports = compiled("llama3_8b", "v5e-8", tp=8)
    single, _ = compiled("llama3_8b", "v5e-1")
    assert runner.weight_bytes < single.weight_bytes / 4  # split by heads and vocabulary
    assert runner.kv_cache.pages[0].sharding.shard_shape(runner.kv_cache.pages[0].shape)[0] == 1
    assert_clean(runner, reports)


def test_the_generic_write_copies_the_tpu_pool(monkeypatch):
    """The scatter every other backend writes with ([num_kv_heads, head_dim] windows into the
    pool viewed as [num_kv_heads, slots, head_dim]), on the TPU: XLA:TPU copies the pool into
    its layout and back, layer by layer, which the report counts (the TPU's own write has no
    copy: the tests above). At the default pool size such a step does not even fit (26 GiB of
    temporaries on a 16 GiB v5e); a 1 GiB pool shows the copies."""
    monkeypatch.setattr(TpuBackend, "write_kv", AttentionBackend.write_kv)
    runner, reports = compile_steps("llama3_8b", "v5e-1", only="decode", pool_gib=1.0)
    assert reports[0].findings.pool_copies >= runner.config.num_layers, reports[0]


def test_scan_slices_each_layers_weights_on_h100():
    """The H200's measurement behind models/layer_loop.py, without a GPU: under the scan over
    stacked weights, XLA:GPU slices every projection of a layer into a new buffer (7 per
    layer here: 416 MiB at Llama-3-8B's sizes); unrolled, none."""
    runner, reports = compiled("llama3_8b", "h100", layer_loop="scan", only="decode")
    assert reports[0].findings.weight_copies >= 7, reports[0].findings
    _, unrolled = compiled("llama3_8b", "h100")
    assert unrolled[0].findings.weight_copies == 0
