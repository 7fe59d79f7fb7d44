"""Loader: HF directories (single and sharded), errors that name the bad input, the parameter
cache."""

from __future__ import annotations

import json

import jax
import numpy as np
import pagedjax.models.loader as loader
import pytest
from hf_models import make_tiny_model
from pagedjax.models.config import ModelConfig
from pagedjax.models.loading import cache, gguf


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama_gqa", path)
    return path


def _leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_sharded_checkpoint_loads_like_single(tmp_path, tiny_dir):
    hf = make_tiny_model("llama_gqa", tmp_path / "sharded")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = loader.load_model(str(tiny_dir), use_cache=False)
    b = loader.load_model(str(tmp_path / "sharded"), use_cache=False)
    assert a.config == b.config
    for x, y in zip(_leaves(a.params), _leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)


def test_second_load_comes_from_the_orbax_cache(tmp_path, tiny_dir, monkeypatch):
    first = loader.load_model(str(tiny_dir), cache_dir=tmp_path)
    assert list((tmp_path / "params").glob("*/COMPLETE"))

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again instead of restoring the cache")

    monkeypatch.setattr(loader, "convert", no_convert)
    second = loader.load_model(str(tiny_dir), cache_dir=tmp_path)
    assert second.config == first.config
    for x, y in zip(_leaves(first.params), _leaves(second.params), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_cache_entry_is_never_overwritten_by_a_second_writer(tmp_path, tiny_dir):
    """Two processes converting at once: the first whole entry stays, the second is dropped."""
    loaded = loader.load_model(str(tiny_dir), use_cache=False)
    ckpt = tmp_path / "params" / "entry"
    cache.save(ckpt, loaded.config, loaded.params)
    first = sorted(p.stat().st_mtime_ns for p in ckpt.rglob("*"))
    cache.save(ckpt, loaded.config, loaded.params)
    assert sorted(p.stat().st_mtime_ns for p in ckpt.rglob("*")) == first
    assert [p.name for p in ckpt.parent.iterdir()] == ["entry"]  # no temporary left behind
    (ckpt / "COMPLETE").unlink()  # a half-written entry is replaced
    cache.save(ckpt, loaded.config, loaded.params)
    assert (ckpt / "COMPLETE").exists()
    config, params = cache.restore(ckpt, "float32", None)
    for x, y in zip(_leaves(loaded.params), _leaves(params), strict=True):
        np.testing.assert_array_equal(x, y)


def test_an_entry_is_one_mapped_file_and_orbax_entries_still_restore(tmp_path, tiny_dir):
    """A single process writes its entry as one file of arrays plus an index, restored by
    mapping the file; entries orbax wrote (earlier versions, multi-process runs) restore too."""
    import orbax.checkpoint as ocp

    loaded = loader.load_model(str(tiny_dir), dtype="bfloat16", use_cache=False)
    raw = tmp_path / "raw"
    cache.save(raw, loaded.config, loaded.params)
    assert sorted(p.name for p in raw.iterdir()) == [
        "COMPLETE", "config.json", "params.bin", "params.json"
    ]  # fmt: skip
    index = json.loads((raw / "params.json").read_text())["arrays"]
    assert all(entry["offset"] % 64 == 0 for entry in index)
    old = tmp_path / "orbax"
    (old / "params").parent.mkdir()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((old / "params").absolute(), loaded.params)
    (old / "config.json").write_text((raw / "config.json").read_text())
    (old / "COMPLETE").touch()
    for entry in (raw, old, old):  # the orbax entry gains the mapped file on its first restore
        config, params = cache.restore(entry, "bfloat16", None)
        assert (entry / "params.json").exists()
        assert config == loaded.config
        assert jax.tree.structure(params) == jax.tree.structure(loaded.params)
        for x, y in zip(_leaves(loaded.params), _leaves(params), strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)


def test_bfloat16_params(tiny_dir):
    loaded = loader.load_model(str(tiny_dir), dtype="bfloat16", use_cache=False)
    assert {x.dtype for x in jax.tree.leaves(loaded.params)} == {np.dtype(jax.numpy.bfloat16)}


def test_nonexistent_path_is_named():
    with pytest.raises(ValueError, match="does-not-exist"):
        loader.load_model("/tmp/does-not-exist/model")


def test_unreachable_hub_id_is_named(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="someone/no-such-model"):
        loader.load_model("someone/no-such-model")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        loader.load_model(str(tmp_path))


def test_missing_weights_are_reported(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="no .safetensors"):
        loader.load_model(str(tmp_path))


def test_unsupported_rope_scaling_is_named():
    base = json.loads(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,'
        ' "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}'
    )
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_gguf_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 5
    w = np.random.default_rng(0).normal(size=(heads * head_dim, hidden)).astype(np.float32)
    # llama.cpp's convert_hf_to_gguf permutation of Q/K rows.
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    config = ModelConfig("LlamaForCausalLM", 8, hidden, 8, 1, heads, heads, head_dim)
    np.testing.assert_array_equal(gguf.unpermute("num_heads")(permuted, config), w.T)
