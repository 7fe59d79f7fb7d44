"""Logits and greedy-token parity with Hugging Face transformers (PyTorch, CPU, float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import TINY_CONFIGS, make_tiny_model
from pagedjax.models.loader import load_model

from pagedjax import LLM, SamplingParams
from pagedjax.worker.runner import Runner, RunnerConfig, ScheduledSeq

BLOCK = 8
PROMPT_LENS = [1, 5, 8, 16, 23]  # 8 and 16 end exactly on a block boundary
RTOL = 1e-4


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    rng = np.random.default_rng(len(request.param))
    prompts = [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]
    return request.param, path, hf, prompts


def _tables(prompts, total_len):
    """Disjoint, shuffled block tables big enough for total_len tokens per prompt."""
    per = -(-total_len // BLOCK)
    ids = np.random.default_rng(0).permutation(np.arange(1, 1 + per * len(prompts)))
    return [ids[i * per : (i + 1) * per].tolist() for i in range(len(prompts))]


def test_prefill_and_decode_logits(tiny):
    name, path, hf, prompts = tiny
    loaded = load_model(str(path))
    steps = 6
    runner = Runner(
        loaded.config,
        loaded.params,
        RunnerConfig(num_blocks=64, block_size=BLOCK, max_model_len=64),
    )
    tables = _tables(prompts, max(PROMPT_LENS) + steps)
    # Prefill: all prompts packed into one ragged step; logits at every position.
    logits = runner.forward_logits(
        [ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables, strict=True)], all_positions=True
    )
    row, seqs = 0, [list(p) for p in prompts]
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        err = rel_err(logits[row : row + len(p)], ref)
        assert err < RTOL, f"{name} prefill len {len(p)}: rel err {err:.2e}"
        row += len(p)
    # Decode step by step, all sequences batched, feeding HF's greedy choice.
    for step in range(steps):
        with torch.no_grad():
            refs = [hf(torch.tensor([s])).logits[0, -1].numpy() for s in seqs]
        for s, ref in zip(seqs, refs, strict=True):
            s.append(int(ref.argmax()))
        ours = runner.forward_logits(
            [ScheduledSeq([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
        )
        with torch.no_grad():
            refs = [hf(torch.tensor([s])).logits[0, -1].numpy() for s in seqs]
        for i, ref in enumerate(refs):
            err = rel_err(ours[i], ref)
            assert err < RTOL, f"{name} decode step {step} seq {i}: rel err {err:.2e}"


def test_greedy_tokens_match_hf_generate(tiny):
    name, path, hf, prompts = tiny
    llm = LLM(str(path), block_size=BLOCK, max_model_len=128, num_blocks=64)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False
    )
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS may be chosen, never stops
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
        assert len(ref) == 32
        assert out.outputs[0].token_ids == ref, f"{name} prompt len {len(p)}"
        assert out.prompt_token_ids == p
    assert llm.get_stats().num_blocks_used == 0
