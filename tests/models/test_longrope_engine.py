"""Phi-3's LongRoPE through the engine: speculation (n-gram and draft model) gives HF generate's
greedy tokens (proposals are capped at the original context, so no step crosses the switch with
short-factor KV), and a token budget that cannot hold a re-run past the switch is refused."""

from __future__ import annotations

import pytest
from hf_models import hf_greedy, make_tiny_model, speculation_prompts

from pagedjax import LLM, SamplingParams

BLOCK = 8
SWITCH = 32  # tests/support/hf_models.py phi3: original_max_position_embeddings
MAX_TOKENS = 24
# Prompts that reach the switch while decoding; one repeats itself, so n-gram lookup proposes.
PROMPT_LENS = [13, 16, 23]
POOL = dict(block_size=BLOCK, max_model_len=64, num_blocks=64, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tmp_path_factory.mktemp("longrope_phi3")
    hf = make_tiny_model("phi3", path)
    prompts = speculation_prompts(PROMPT_LENS, seed=11)
    want = hf_greedy(hf, prompts, MAX_TOKENS)
    return str(path), prompts, want


SPECS = {
    "ngram": lambda path: {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    },
    "draft_model": lambda path: {
        "method": "draft_model",
        "model": path,  # the target's own weights: proposals almost always accepted
        "num_speculative_tokens": 4,
    },
}


@pytest.mark.parametrize("method", sorted(SPECS))
def test_speculation_matches_hf_generate_across_the_longrope_switch(phi3, method):
    path, prompts, want = phi3
    llm = LLM(path, speculative_config=SPECS[method](path), **POOL)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for p, out, w in zip(prompts, outs, want, strict=True):
        assert out.outputs[0].token_ids == w, f"{method}, prompt len {len(p)}"
    stats = llm.get_stats()
    assert stats.spec_decoding.num_draft_tokens > 0
    assert llm.engine.scheduler.num_longrope_recomputes == len(prompts)


def test_a_token_budget_within_the_original_context_is_refused(phi3):
    path = phi3[0]
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=24.*\b32\b"):
        LLM(path, block_size=BLOCK, max_model_len=64, num_blocks=64, max_num_batched_tokens=24)
    # A model length within the original context never crosses the switch: any budget runs.
    llm = LLM(path, block_size=BLOCK, max_model_len=SWITCH, num_blocks=64, max_num_batched_tokens=8)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
