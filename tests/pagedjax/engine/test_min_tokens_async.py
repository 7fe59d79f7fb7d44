"""min_tokens k under async scheduling (the default) as without it and as vLLM: stop token ids
and EOS are held back for exactly k tokens, not k + 1. The step in flight counts a placeholder
token that the output does not hold yet; the sampling rows of the next step count it too
(engine/request.py ``sampling_rows``)."""

from __future__ import annotations

import pytest
from hf_models import make_tiny_model, save_word_tokenizer

from pagedjax import LLM, SamplingParams

STOP = 11


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("min_tokens_async")
    make_tiny_model("llama_gqa", path)
    save_word_tokenizer(path)
    return str(path)


def test_min_tokens_holds_stops_back_for_exactly_k_tokens(path):
    """A logit bias makes STOP every step's greedy token: each output is k other tokens, then
    STOP, finish "stop" (synchronous steps: tests/models/test_sampling_extras.py)."""
    llm = LLM(path, block_size=8, max_model_len=64, async_scheduling=True)
    prompts = [[5, 6, 7], [9, 10, 12, 13, 14], [20]]
    for k in (1, 2, 5):
        params = SamplingParams(
            max_tokens=16,
            temperature=0,
            min_tokens=k,
            stop_token_ids=[STOP],
            logit_bias={STOP: 100.0},
        )
        for out in llm.generate(prompts, params, use_tqdm=False):
            c = out.outputs[0]
            assert len(c.token_ids) == k + 1 and c.token_ids[-1] == STOP, (k, c.token_ids)
            assert STOP not in c.token_ids[:k] and c.finish_reason == "stop"
    assert llm.engine.get_stats().num_overlapped_steps > 0  # the path under test ran
