"""What a GPU or a TPU runs, run on a CPU: the engine with that platform's attention kernels (in
interpret mode) and the layers unrolled over one parameter tree per layer (the default off a CPU,
models/layer_loop.py), its greedy tokens against transformers through chunked prefill, prefix
hits and preemption (the TPU's, and the families whose layers differ, under ``-m slow``). Each
piece has tests of its own; this one checks them composed, as the step programs a device
compiles compose them (the device check's stage 3a checks the same on the device)."""

from __future__ import annotations

import pytest
from hf_models import hf_greedy, make_tiny_model, random_prompts, save_word_tokenizer, tiny_llama_hf
from pagedjax.models import layer_loop
from pagedjax.pallas_kernels.tpu import TpuBackend
from pagedjax.pallas_kernels.triton import TritonBackend

from pagedjax import LLM, SamplingParams, pallas_kernels

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = tiny_llama_hf(tmp_path_factory, "tiny_accelerator_paths")
    prefix = list(range(3, 30))  # shared by the last prompts: prefix-cache hits
    prompts = random_prompts(4, 11, 1, 40) + random_prompts(3, 12, 2, 20, prefix=prefix)
    return path, prompts, hf_greedy(hf, prompts, MAX_TOKENS)


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(TritonBackend(interpret=True), id="gpu"),
        # The TPU interpreter compiles for about half a minute here: slow.
        pytest.param(TpuBackend(interpret=True), id="tpu", marks=pytest.mark.slow),
    ],
)
def test_kernels_and_unrolled_layers_give_transformers_tokens(tiny, backend, monkeypatch):
    path, prompts, want = tiny
    # A token budget of 16 chunks the longer prompts; 11 usable blocks of 8 for 4 sequences preempt.
    llm = accelerator_llm(path, backend, monkeypatch, max_num_batched_tokens=16)
    assert [list(o.outputs[0].token_ids) for o in generate(llm, prompts)] == want
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral_window", "mixtral", "phi3"])
def test_families_whose_layers_differ_on_the_gpu_path(family, tmp_path, monkeypatch):
    # Sliding windows (their blocks freed behind the window), soft caps, local and global rope,
    # experts, LongRoPE (phi3: the switch at 32 tokens within the token budget of 48).
    hf = make_tiny_model(family, tmp_path)
    save_word_tokenizer(tmp_path)
    prompts = random_prompts(5, 3, 1, 50)
    want = hf_greedy(hf, prompts, MAX_TOKENS)
    backend = TritonBackend(interpret=True)
    llm = accelerator_llm(str(tmp_path), backend, monkeypatch, max_num_batched_tokens=48)
    assert [list(o.outputs[0].token_ids) for o in generate(llm, prompts)] == want


def accelerator_llm(path: str, backend, monkeypatch, **kwargs) -> LLM:
    """An engine of 11 usable blocks of 8 for 4 sequences of up to 80 tokens, with ``backend``'s
    kernels and the layers unrolled."""
    monkeypatch.setenv(layer_loop.ENV_LAYER_LOOP, "unrolled")
    monkeypatch.setattr(pallas_kernels, "select_backend", lambda *a, **kw: backend)
    llm = LLM(path, block_size=8, max_model_len=80, num_blocks=12, max_num_seqs=4, seed=0, **kwargs)
    assert llm.runner.backend is backend
    assert layer_loop.is_per_layer(llm.runner.params)
    return llm


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
