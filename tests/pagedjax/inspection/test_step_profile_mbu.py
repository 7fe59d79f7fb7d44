"""The step profile's MBU: the bytes a step must read (weights once + the KV pages attention reads,
whole pages up to each sequence's context), host and device ms per step kind, get_stats and
/metrics."""

from __future__ import annotations

import numpy as np
import pytest
from hf_models import make_tiny_model

from pagedjax import LLM, SamplingParams
from pagedjax.inspection.step_profile import StepProfile
from pagedjax.metrics.server import ServerMetrics
from pagedjax.worker.input_batch import InputBatcher, ScheduledSeq, count_padding


def test_step_bytes_are_the_weights_once_plus_whole_pages_up_to_each_context():
    profile = StepProfile()
    profile.set_model_bytes(weight_bytes=1000, kv_page_bytes=64)
    batcher = InputBatcher(block_size=4, max_model_len=64)
    # contexts 5 (2 pages), 8 (2 pages), 9 (3 pages): 7 pages
    seqs = [
        ScheduledSeq([1], 4, [1, 2]),
        ScheduledSeq([2], 7, [3, 4]),
        ScheduledSeq([3], 8, [5, 6, 7]),
    ]
    assert count_padding(profile, seqs, batcher.build(seqs), 4) == "decode"
    prefill = [ScheduledSeq([1, 2, 3], 2, [8, 9])]  # context 5: 2 pages
    assert count_padding(profile, prefill, batcher.build(prefill), 4) == "prefill"
    assert profile.kinds["decode"].bytes_read == 1000 + 7 * 64
    assert profile.kinds["prefill"].bytes_read == 1000 + 2 * 64


def test_host_phases_fall_to_their_step_kind():
    profile = StepProfile()
    profile.copy_bytes_per_s = 1e9  # no measurement here
    profile.enabled = True
    with profile.phase("schedule"):
        pass
    profile.count("decode", 1, 1, 1, 1, kv_pages=1)
    with profile.phase("output"):
        pass
    k = profile.kinds["decode"]
    assert k.host_seconds == pytest.approx(profile.seconds["schedule"] + profile.seconds["output"])
    assert k.host_seconds > 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mbu_llama")
    make_tiny_model("llama_gqa", path)
    return path


def _hand_weight_and_page_bytes(model_dir, block_size: int, itemsize: int):
    import json

    c = json.loads((model_dir / "config.json").read_text())
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    per_layer = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * i + 2 * h
    lm_head = 0 if c.get("tie_word_embeddings") else c["vocab_size"] * h
    embed = c["vocab_size"] * h if c.get("tie_word_embeddings") else 0  # the head reads it
    weights = (layers * per_layer + h + lm_head + embed) * itemsize
    page = 2 * layers * kv_heads * block_size * d * itemsize
    return weights, page


def test_get_stats_reports_host_device_ms_and_a_sane_mbu(model_dir):
    llm = LLM(str(model_dir), block_size=8, num_blocks=64, max_model_len=64, seed=0)
    try:
        profile = llm.engine.profile
        weights, page = _hand_weight_and_page_bytes(model_dir, 8, 4)  # float32 on a CPU
        assert (profile.weight_bytes, profile.kv_page_bytes) == (weights, page)
        assert llm.get_stats().step_kinds == {} and llm.get_stats().mbu is None
        profile.enabled = True
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 256, n).tolist() for n in (5, 11, 17)]
        llm.generate(
            prompts,
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        )
        stats = llm.get_stats()
    finally:
        llm.close()
    assert stats.copy_gbps > 0
    assert {"prefill", "decode"} <= set(stats.step_kinds)
    for row in stats.step_kinds.values():
        assert row["steps"] > 0 and row["host_ms"] > 0 and row["device_ms"] > 0
        assert row["bytes_per_step"] >= weights + page
        assert 0 < row["mbu"] <= 2.0  # sanity, not a timing claim: bytes over time over copy
    assert 0 < stats.mbu <= 2.0
    metrics = ServerMetrics()
    metrics.publish(stats)
    text = metrics.render().decode()
    for name in ("step_host_milliseconds", "step_device_milliseconds", "step_mbu"):
        assert f'pagedjax_{name}{{step_kind="decode"}}' in text
    assert "pagedjax_copy_bandwidth_gbps" in text
