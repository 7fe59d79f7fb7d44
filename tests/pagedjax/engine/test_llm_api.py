"""The LLM front door: outputs, stops, limits, and bad input named in clear errors."""

from __future__ import annotations

import pytest
from hf_models import random_prompts, tiny_llama_dir

from pagedjax import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "engine_llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, block_size=8, num_blocks=128, max_model_len=96, seed=0)


def _prompts(n, seed=0):
    return random_prompts(n, seed, hi=30)


def test_outputs_follow_prompt_order_and_free_every_block(llm):
    prompts = _prompts(6)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    stats = llm.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_blocks_peak > 0
    assert 0 < stats.kv_utilization <= 1
    # Each sequence alone gives the same tokens as in the batch.
    alone = llm.generate(prompts[2], GREEDY, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_stop_token_ids_and_eos(llm):
    prompt = _prompts(1, seed=3)[0]
    free_run = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free_run[5]
    out = llm.generate(
        prompt,
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    first = free_run.index(stop_at)
    assert out.outputs[0].token_ids == free_run[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_max_model_len_caps_generation(model_dir):
    llm = LLM(model_dir, block_size=8, num_blocks=128, max_model_len=40)
    out = llm.generate([5] * 30, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([3] * 96, "prompt 1: .* 96 tokens .* max_model_len=96"),
        ([3, 256, 4], "token id 256 is outside the vocabulary"),
        ([3, -1], "token id -1"),
        ([], "prompt 1: .* the prompt is empty"),
        ("hello", "no tokenizer"),
    ],
)
def test_bad_prompts_raise_before_anything_runs(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[3, 4], prompt], GREEDY, use_tqdm=False)
    assert llm.get_stats().num_blocks_used == 0
    # The engine still serves afterwards.
    assert llm.generate([3, 4], GREEDY, use_tqdm=False)[0].finished


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=-3), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(_prompts(3), [GREEDY, GREEDY], use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_blocks=5, max_model_len=96), "num_blocks=5"),
        (dict(max_model_len=100000), "max_model_len=100000"),
        (dict(dtype="float16"), "dtype"),
        (dict(block_size=12), "block_size"),
    ],
)
def test_bad_engine_config(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, **{"block_size": 8, **kwargs})


def test_close_frees_device_memory(model_dir):
    llm = LLM(model_dir, block_size=8, num_blocks=16, max_model_len=96)
    pool = llm.runner.kv_cache.pages
    llm.close()
    assert all(pages.is_deleted() for pages in pool)  # (k_pages, v_pages)
