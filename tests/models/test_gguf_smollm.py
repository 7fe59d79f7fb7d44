"""The real SmolLM2-135M-Instruct GGUF: our loader vs transformers' own GGUF loader."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from pagedjax.models.loader import default_model_path

from pagedjax import LLM, SamplingParams
from pagedjax.worker.runner import ScheduledSeq

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, max_model_len=256, num_blocks=64)


def test_config_read_from_gguf(llm):
    c = llm.model_config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size) == (30, 9, 3, 576)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0


def test_prefill_logits_match_transformers(llm, hf_model):
    ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    # Block 3 is free between generate calls: write there like a one-sequence step.
    ours = llm.runner.forward_logits([ScheduledSeq(ids, 0, [3])], all_positions=True)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert err < 1e-4, f"rel err {err:.2e}"


def test_greedy_tokens_match_transformers(llm, hf_model):
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False
    )
    hf_model.generation_config.eos_token_id = None
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref, out.prompt
    assert outs[0].outputs[0].text.startswith(" Paris")


def test_chat_template_answers(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its turn with EOS


def test_cli_generate(gguf_path, capsys):
    from pagedjax.cli import main

    rc = main(
        [
            "generate",
            "--model",
            gguf_path,
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "4",
            "--max-model-len",
            "256",
            "--num-blocks",
            "64",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "Paris" in out and "KV pool: 63 blocks x 16 tokens" in out


def test_the_fast_reader_reads_what_ggufs_reader_reads(gguf_path):
    import gguf
    from pagedjax.models.loading.gguf import _fast_reader

    ours, theirs = _fast_reader(gguf.GGUFReader)(gguf_path), gguf.GGUFReader(gguf_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
        assert ours.fields[name].types == field.types, name
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert a.data_offset == b.data_offset and np.array_equal(a.data, b.data), a.name
