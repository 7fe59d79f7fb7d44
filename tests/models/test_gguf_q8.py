"""A Q8_0 GGUF loads as int8 kernels with the file's own block scales (int8-g32's layout), which
dequantize bit for bit to the dequantize-on-load path's weights. The file is a tiny random Llama
written with the gguf package (every 2D tensor Q8_0, as llama.cpp writes a Q8_0 model)."""

from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pagedjax.models.loader as loader
import pytest
from flax.traverse_util import flatten_dict
from gguf import GGMLQuantizationType as QT
from pagedjax.models import quant

import pagedjax.engine.llm_engine
import pagedjax.engine.model_loading
import pagedjax.entrypoints.llm
from pagedjax import LLM, SamplingParams
from pagedjax.worker.runner import ScheduledSeq

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def write_gguf(path, seed: int = 0, f16_tensor: str | None = None) -> dict[str, np.ndarray]:
    """A tiny Llama GGUF, 2D tensors in Q8_0 (``f16_tensor`` in float16), norms in float32;
    returns the float32 weights it was quantized from (GGUF names)."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    shapes["output_norm.weight"] = (HIDDEN,)
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes[b + "attn_q.weight"] = (HEADS * HEAD_DIM, HIDDEN)
        shapes[b + "attn_k.weight"] = (KV_HEADS * HEAD_DIM, HIDDEN)
        shapes[b + "attn_v.weight"] = (KV_HEADS * HEAD_DIM, HIDDEN)
        shapes[b + "attn_output.weight"] = (HIDDEN, HEADS * HEAD_DIM)
        shapes[b + "ffn_gate.weight"] = (INTER, HIDDEN)
        shapes[b + "ffn_up.weight"] = (INTER, HIDDEN)
        shapes[b + "ffn_down.weight"] = (HIDDEN, INTER)
        shapes[b + "attn_norm.weight"] = (HIDDEN,)
        shapes[b + "ffn_norm.weight"] = (HIDDEN,)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_vocab_size(VOCAB)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # a norm's scale
            weights[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, weights[name])
            continue
        weights[name] = (0.15 * rng.standard_normal(shape)).astype(np.float32)
        if name == f16_tensor:
            w.add_tensor(name, weights[name].astype(np.float16))
        else:
            q = gguf.quants.quantize(weights[name], QT.Q8_0)
            w.add_tensor(name, q, raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf"
    write_gguf(path)
    return str(path)


@pytest.fixture(scope="module")
def kept(q8_file):
    return loader.load_model(q8_file, use_cache=False)


@pytest.fixture(scope="module")
def dequantized(q8_file):
    return loader.load_model(q8_file, use_cache=False, dequantize_gguf=True)


def _file_blocks(path: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [out, in], float16 scales [out, in / 32]) of a Q8_0 tensor, read from the bytes."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    blocks = np.asarray(t.data).reshape(-1, 34)
    out = int(t.shape[1])
    scales = blocks[:, :2].copy().view(np.float16).reshape(out, -1)
    return blocks[:, 2:].copy().view(np.int8).reshape(out, -1), scales


def test_kernels_are_int8_with_the_files_scales(q8_file, kept):
    layers = kept.params["layers"]
    v = layers["self_attn"]["v_proj"]
    assert v["kernel"].dtype == jnp.int8
    assert v["kernel_scale"].shape == (LAYERS, HIDDEN // 32, KV_HEADS * HEAD_DIM)
    values, scales = _file_blocks(q8_file, "blk.1.attn_v.weight")  # stored [out, in]
    np.testing.assert_array_equal(np.asarray(v["kernel"][1]), values.T)
    np.testing.assert_array_equal(np.asarray(v["kernel_scale"][1]), scales.T.astype(np.float32))
    flat = flatten_dict(kept.params, sep="/")
    assert {k for k, x in flat.items() if x.dtype == jnp.int8} == {
        k for k in flat if k.endswith("/kernel")
    }  # every linear kernel (the untied LM head too), nothing else
    assert flat["lm_head/kernel_scale"].shape == (HIDDEN // 32, VOCAB)
    assert flat["embed_tokens/embedding"].dtype == jnp.float32  # the embedding stays float
    assert kept.quantization == quant.GGUF_Q8_0 == "int8-g32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantize_bit_for_bit_like_the_dequantizing_path(q8_file, kept, dequantized, dtype):
    if dtype == "bfloat16":
        kept = loader.load_model(q8_file, dtype=dtype, use_cache=False)
        dequantized = loader.load_model(q8_file, dtype=dtype, use_cache=False, dequantize_gguf=True)
    ours = flatten_dict(kept.params, sep="/")
    ref = flatten_dict(dequantized.params, sep="/")
    assert set(ours) == set(ref) | {k + "_scale" for k in ref if k.endswith("/kernel")}
    for path, want in ref.items():
        got = ours[path]
        if path.endswith("/kernel"):  # as models.layers.Dense computes it inside the step
            got = quant.dequantize(got, ours[path + "_scale"], jnp.dtype(dtype))
        assert got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)


def test_greedy_tokens_and_logits_as_the_dequantizing_path(q8_file, monkeypatch):
    monkeypatch.setattr(
        pagedjax.engine.llm_engine, "load_tokenizer", lambda loaded: None
    )  # ids only
    prompts = [[5, 9, 33, 2, 71, 8], [100, 4, 7]]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = {}
    for keep in (True, False):
        load = functools.partial(loader.load_model, dequantize_gguf=not keep, use_cache=False)
        monkeypatch.setattr(pagedjax.engine.model_loading, "load_model", load)
        llm = LLM(q8_file, num_blocks=32, block_size=8, max_model_len=64)
        kernel = llm.runner.params["layers"]["mlp"]["up_proj"]["kernel"]
        assert kernel.dtype == (jnp.int8 if keep else jnp.float32)
        # The engine's config says what the kernels are, though LLM was given no quantization.
        assert llm.engine.config.quantization == ("int8-g32" if keep else None)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        logits = llm.runner.forward_logits([ScheduledSeq(prompts[0], 0, [3])], all_positions=True)
        results[keep] = [list(o.outputs[0].token_ids) for o in outs], np.asarray(logits)
        llm.close()
    assert results[True][0] == results[False][0]
    if jax.default_backend() == "cpu":  # the dot sees the same kernel values: same logits
        np.testing.assert_array_equal(results[True][1], results[False][1])
    else:  # a backend may fuse the dequantization into the dot differently
        np.testing.assert_allclose(results[True][1], results[False][1], rtol=1e-5, atol=1e-5)


def test_orbax_cache_round_trip_keeps_int8_apart_from_float(q8_file, kept, tmp_path, monkeypatch):
    first = loader.load_model(q8_file, cache_dir=tmp_path)
    floats = loader.load_model(q8_file, cache_dir=tmp_path, dequantize_gguf=True)
    assert len(list((tmp_path / "params").glob("*/COMPLETE"))) == 2  # two entries, no collision

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again instead of restoring the cache")

    monkeypatch.setattr(loader, "convert", no_convert)
    monkeypatch.setattr(gguf, "GGUFReader", no_convert)  # its kernel types are cached too
    again = loader.load_model(q8_file, cache_dir=tmp_path, quantization="int8-g32")
    floats_again = loader.load_model(q8_file, cache_dir=tmp_path, dequantize_gguf=True)
    for a, b, c in zip(*(jax.tree.leaves(x.params) for x in (kept, first, again)), strict=True):
        assert a.dtype == b.dtype == c.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert floats_again.params["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.float32
    assert (first.quantization, again.quantization, floats_again.quantization) == (
        "int8-g32",
        "int8-g32",
        None,
    )
    pairs = zip(jax.tree.leaves(floats.params), jax.tree.leaves(floats_again.params), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_second_rounding_is_refused(q8_file):
    with pytest.raises(ValueError, match=r"Q8_0 GGUF.*quantization='int8'"):
        loader.load_model(q8_file, quantization="int8", use_cache=False)
    requantized = loader.load_model(
        q8_file, quantization="int8", use_cache=False, dequantize_gguf=True
    )
    assert requantized.params["lm_head"]["kernel_scale"].shape == (VOCAB,)  # per channel


def test_mixed_file_dequantizes(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_gguf(path, f16_tensor="blk.1.ffn_down.weight")
    loaded = loader.load_model(str(path), use_cache=False)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(loaded.params))
