"""Quantized MoE experts (models/moe.py, models/quant.py): a tiny Qwen2-MoE's expert stacks in 8
bits with a scale per output channel, the grouped matmuls on the int8 kernels converted inside the
step; against float experts set to the dequantized values (same numbers, another rounding order)
and against the float model (the quantization's own error, measured)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pagedjax.models.loader as loader
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict
from hf_models import make_tiny_model
from pagedjax.models import quant

from pagedjax.bench.quality import compare, teacher_forced_logits
from pagedjax.worker.runner import Runner, RunnerConfig


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_moe_q")
    make_tiny_model("qwen2_moe", path)  # shared expert, one dense layer
    return path


def _logits(loaded, params, tokens):
    runner = Runner(
        loaded.config, params, RunnerConfig(num_blocks=32, block_size=8, max_model_len=128)
    )
    return teacher_forced_logits(runner, tokens)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_experts_quantized_per_channel_match_dequantized_float_experts(moe_dir, method):
    loaded = loader.load_model(str(moe_dir), use_cache=False, quantization=method)
    flat = flatten_dict(loaded.params)
    c = loaded.config
    n_moe = sum(c.moe_layers)
    gate = flat[("moe", "experts", "gate_proj")]
    assert gate.dtype == quant.storage_dtype(method)
    assert flat[("moe", "experts", "gate_proj_scale")].shape == (
        n_moe,
        c.num_experts,
        c.moe_intermediate_size,
    )
    assert flat[("moe", "experts", "down_proj_scale")].shape == (n_moe, c.num_experts, 64)
    for float_path in [("moe", "router", "kernel"), ("moe", "shared_expert", "up_proj", "kernel")]:
        assert flat[float_path].dtype == jnp.float32  # router and shared expert stay float
    assert flat[("dense_mlp", "up_proj", "kernel")].dtype == jnp.float32
    deq = {}
    for k, v in flat.items():
        if k[-1].endswith("_scale"):
            continue
        scale = flat.get(quant.scale_path(k))
        deq[k] = v if scale is None else quant.dequantize_kernel(v, scale)
    tokens = np.random.default_rng(3).integers(3, 256, 40).tolist()
    ours = _logits(loaded, loaded.params, tokens)
    ref = _logits(loaded, unflatten_dict(deq), tokens)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_int8_experts_close_to_the_float_model(moe_dir):
    """Only the experts' error: the float model against one whose experts alone are int8."""
    floats = loader.load_model(str(moe_dir), use_cache=False)
    q = loader.load_model(str(moe_dir), use_cache=False, quantization="int8")
    flat, qflat = flatten_dict(floats.params), flatten_dict(q.params)
    mixed = {k: v for k, v in flat.items()}
    for k in [k for k in qflat if k[:2] == ("moe", "experts")]:
        mixed[k] = qflat[k]  # int8 experts and their scales, everything else float
    tokens = np.random.default_rng(4).integers(3, 256, 48).tolist()
    ref = _logits(floats, floats.params, tokens)
    ours = _logits(floats, unflatten_dict(mixed), tokens)
    stats = compare(ref, ours)
    rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
    print(f"tiny qwen2-moe, int8 experts vs float: {stats}, max rel err {rel:.2e}")
    assert stats["top1"] >= 0.95 and stats["mean_kl"] < 1e-3 and rel < 3e-2
