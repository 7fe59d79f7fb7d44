"""Weight-only quantization (models/quant.py): the kernels against a float64 numpy reference, what
is and is not quantized, the orbax cache, the on-the-fly dequantization in the step, and a tiny
random Llama's top-1 agreement with its float32 self."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pagedjax.models.loader as loader
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict
from hf_models import make_tiny_model
from pagedjax.models import quant
from pagedjax.models.llama import param_shapes

from pagedjax import LLM, SamplingParams
from pagedjax.bench.quality import compare, teacher_forced_logits
from pagedjax.config import QUANTIZATIONS, EngineConfig
from pagedjax.worker.runner import Runner, RunnerConfig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_q")
    make_tiny_model("llama_gqa", path)
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_tied_q")
    make_tiny_model("llama3_rope_tied", path)
    return path


def test_quantizations_agree():
    assert quant.QUANTIZATIONS == QUANTIZATIONS
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="x", quantization="int4")


def test_int8_kernel_against_float64_reference():
    w = np.random.default_rng(0).standard_normal((3, 64, 48)).astype(np.float32)
    w[1, :, 5] = 0.0  # an all-zero column: scale 1, values 0
    q, scale = quant.quantize_kernel(jnp.asarray(w), "int8")
    assert q.dtype == jnp.int8 and scale.shape == (3, 48) and scale.dtype == jnp.float32
    w64 = w.astype(np.float64)
    ref_scale = np.abs(w64).max(axis=-2) / 127.0
    ref_scale[1, 5] = 1.0
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-6)
    ref_q = np.clip(np.round(w64 / ref_scale[:, None, :]), -127, 127)
    assert np.abs(np.asarray(q, np.float64) - ref_q).max() <= 1  # ties may round either way
    deq = np.asarray(quant.dequantize_kernel(q, scale), np.float64)
    assert np.all(np.abs(deq - w64) <= ref_scale[:, None, :] * 0.5 * (1 + 1e-5) + 1e-12)
    assert np.abs(np.asarray(q)).max() == 127  # each column's largest weight is exact


def test_grouped_int8_kernel_against_float64_reference():
    w = np.random.default_rng(3).standard_normal((2, 128, 24)).astype(np.float32)
    q, scale = quant.quantize_kernel(jnp.asarray(w), "int8-g32")
    assert q.dtype == jnp.int8 and scale.shape == (2, 4, 24)
    grouped = w.astype(np.float64).reshape(2, 4, 32, 24)
    ref_scale = np.abs(grouped).max(axis=2) / 127.0
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-6)
    deq = np.asarray(quant.dequantize_kernel(q, scale), np.float64).reshape(grouped.shape)
    assert np.all(np.abs(deq - grouped) <= ref_scale[:, :, None] * 0.5 * (1 + 1e-5))
    # a kernel whose inputs the group does not divide falls back to a scale per channel
    assert quant.quantize_kernel(jnp.ones((48, 8)), "int8-g32")[1].shape == (8,)


def test_fp8_kernel_against_float64_reference():
    w = np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32)
    q, scale = quant.quantize_kernel(jnp.asarray(w), "fp8")
    assert q.dtype == jnp.float8_e4m3fn
    w64 = w.astype(np.float64)
    ref_scale = np.abs(w64).max(axis=0) / 448.0
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-6)
    ref = (w64 / ref_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * ref_scale
    deq = np.asarray(quant.dequantize_kernel(q, scale), np.float64)
    np.testing.assert_allclose(deq, ref, rtol=1e-6, atol=1e-12)
    # e4m3: 3 mantissa bits, so relative error at most 2**-4 for normal values
    normal = np.abs(w64 / ref_scale) >= 2.0**-6
    assert np.all(np.abs(deq - w64)[normal] <= 2.0**-4 * np.abs(w64)[normal] * (1 + 1e-6))


@pytest.mark.parametrize("method", QUANTIZATIONS)
def test_what_is_quantized(tiny_dir, tied_dir, method):
    storage = quant.storage_dtype(method)
    for path, tied in ((tiny_dir, False), (tied_dir, True)):
        loaded = loader.load_model(str(path), use_cache=False, quantization=method)
        flat = flatten_dict(loaded.params, sep="/")
        shapes = flatten_dict(quant.quantized_shapes(param_shapes(loaded.config), method), sep="/")
        assert {k: (v.shape, v.dtype) for k, v in flat.items()} == {
            k: (v.shape, v.dtype) for k, v in shapes.items()
        }
        kernels = {k for k in flat if k.endswith("/kernel")}
        assert kernels and all(flat[k].dtype == storage for k in kernels)
        assert all(f"{k}_scale" in flat for k in kernels)
        assert ("lm_head/kernel" in kernels) is not tied  # a tied head stays the embedding
        rest = set(flat) - kernels - {f"{k}_scale" for k in kernels}
        assert rest and all(flat[k].dtype == jnp.float32 for k in rest)  # embeddings, norms
        kernel = flat["layers/self_attn/q_proj/kernel"]
        groups = (kernel.shape[1] // int(method.split("-g")[1]),) if "-g" in method else ()
        scale = flat["layers/self_attn/q_proj/kernel_scale"]
        assert scale.shape == (loaded.config.num_layers, *groups, kernel.shape[-1])


def test_quantized_params_come_from_the_orbax_cache(tmp_path, tiny_dir, monkeypatch):
    first = loader.load_model(str(tiny_dir), cache_dir=tmp_path, quantization="int8")
    plain = loader.load_model(str(tiny_dir), cache_dir=tmp_path)  # its own cache entry
    assert len(list((tmp_path / "params").glob("*/COMPLETE"))) == 2
    assert plain.params["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.float32

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again instead of restoring the cache")

    monkeypatch.setattr(loader, "convert", no_convert)
    second = loader.load_model(str(tiny_dir), cache_dir=tmp_path, quantization="int8")
    a, b = flatten_dict(first.params), flatten_dict(second.params)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


def _runner(loaded, params=None):
    params = loaded.params if params is None else params
    return Runner(
        loaded.config, params, RunnerConfig(num_blocks=32, block_size=8, max_model_len=128)
    )


@pytest.mark.parametrize("method", QUANTIZATIONS)
def test_step_dequantizes_on_the_fly(tiny_dir, method):
    """The quantized step's logits equal those of float32 weights set to the dequantized
    values: the scale is applied per output column, inside the step."""
    loaded = loader.load_model(str(tiny_dir), use_cache=False, quantization=method)
    flat = flatten_dict(loaded.params)
    deq = {}
    for k, v in flat.items():
        if k[-1] == quant.SCALE:
            continue
        scale = flat.get((*k[:-1], quant.SCALE))
        deq[k] = v if scale is None else quant.dequantize_kernel(v, scale)
    tokens = np.random.default_rng(2).integers(3, 256, 40).tolist()
    ours = teacher_forced_logits(_runner(loaded), tokens)
    ref = teacher_forced_logits(_runner(loaded, unflatten_dict(deq)), tokens)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_tiny_llama_int8_top1_agreement(tiny_dir):
    """Greedy continuations of the float32 model, teacher-forced through the int8 one: top-1
    agreement and KL measured (close, not identical)."""
    ref_llm = LLM(str(tiny_dir), num_blocks=64, block_size=8, max_model_len=128)
    prompts = [np.random.default_rng(i).integers(3, 256, 8).tolist() for i in range(4)]
    outs = ref_llm.generate(
        prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    q_llm = LLM(str(tiny_dir), quantization="int8", num_blocks=64, block_size=8, max_model_len=128)
    assert q_llm.config.quantization == "int8"
    stats = []
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = prompt + list(out.outputs[0].token_ids)
        ref = teacher_forced_logits(ref_llm.runner, tokens)[len(prompt) - 1 : -1]
        assert np.array_equal(ref.argmax(-1), out.outputs[0].token_ids)  # greedy = argmax
        stats.append(
            compare(ref, teacher_forced_logits(q_llm.runner, tokens)[len(prompt) - 1 : -1])
        )
    top1 = np.mean([s["top1"] for s in stats])
    kl = np.mean([s["mean_kl"] for s in stats])
    print(f"tiny llama int8 vs float32: top-1 agreement {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= 0.9 and kl < 1e-2
