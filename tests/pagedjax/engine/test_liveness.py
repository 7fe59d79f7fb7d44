"""Requests that used to wedge the engine: each now finishes, or is refused before it is queued."""

from __future__ import annotations

import json
import shutil

import pytest
from hf_models import tiny_llama_dir

from pagedjax import LLM, BeamSearchParams, SamplingParams

BLOCK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "liveness_tiny")


@pytest.fixture(scope="module")
def roomy(model_dir):
    return LLM(model_dir, block_size=BLOCK, num_blocks=64, max_model_len=32)


def _greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def test_group_swapped_near_its_end_comes_back(model_dir, roomy):
    """Case 1: 6 usable blocks; an n=2 group swapped out late needed more blocks to swap in
    (held + one per sequence) than the pool had, and generate never returned."""
    small = LLM(model_dir, block_size=BLOCK, num_blocks=7, max_model_len=32, swap_space_gib=0.01)
    prompts = [[5, 6], list(range(10, 21))]
    params = [_greedy(8), _greedy(8, n=2)]
    outs = small.generate(prompts, params, use_tqdm=False)
    want = roomy.generate(prompts, params, use_tqdm=False)
    for got, ref in zip(outs, want, strict=True):
        assert got.finished and got.error is None
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert small.get_stats().num_blocks_used == 0


@pytest.mark.parametrize(
    "params, limit",
    [
        (SamplingParams(n=3, max_tokens=4), "max_num_seqs=2"),
        (BeamSearchParams(beam_width=3, max_tokens=4), "max_num_seqs=2"),
    ],
)
def test_width_above_max_num_seqs_is_refused(model_dir, params, limit):
    """Case 2: n or beam_width above max_num_seqs was queued and never admitted."""
    llm = LLM(model_dir, block_size=BLOCK, num_blocks=32, max_model_len=32, max_num_seqs=2)
    with pytest.raises(ValueError, match=limit):
        if isinstance(params, BeamSearchParams):
            llm.beam_search([[5, 6, 7]], params)
        else:
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_no_chunking_with_a_budget_below_max_model_len_is_refused(model_dir):
    """Case 3: without chunked prefill, a prompt (or a recomputed sequence) longer than the
    budget blocked the queue forever; such a configuration is refused at start."""
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is below max_model_len=32"):
        LLM(
            model_dir,
            block_size=BLOCK,
            num_blocks=32,
            max_model_len=32,
            max_num_batched_tokens=16,
            enable_chunked_prefill=False,
        )


def test_width_above_the_token_budget_is_refused_and_at_it_finishes(model_dir, roomy):
    """Case 4: a swapped n=3 group waited for a budget of 3 tokens that a budget of 2 never had."""
    llm = LLM(model_dir, block_size=BLOCK, num_blocks=9, max_model_len=32, max_num_batched_tokens=2)
    with pytest.raises(ValueError, match="max_num_batched_tokens=2"):
        llm.generate([[5, 6, 7]], _greedy(4, n=3), use_tqdm=False)
    tight = LLM(
        model_dir,
        block_size=BLOCK,
        num_blocks=9,
        max_model_len=32,
        max_num_batched_tokens=3,
        preemption_mode="swap",
    )
    prompts = [[5, 6, 7], list(range(30, 41))]
    params = [_greedy(12), _greedy(12, n=3)]
    outs = tight.generate(prompts, params, use_tqdm=False)
    want = roomy.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in want
    ]
    assert tight.get_stats().num_blocks_used == 0


def test_groups_that_could_never_swap_are_refused(model_dir):
    """Case 5: with no swap space a preempted beam or n>1 group was silently dropped and came
    back finished with no output; such requests are refused up front with the reason."""
    llm = LLM(model_dir, block_size=BLOCK, num_blocks=16, max_model_len=32, swap_space_gib=0)
    with pytest.raises(ValueError, match="swap space"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=8))
    with pytest.raises(ValueError, match="swap space"):
        llm.generate([[5, 6, 7]], _greedy(8, n=2), use_tqdm=False)
    (out,) = llm.generate([[5, 6, 7]], _greedy(8), use_tqdm=False)  # one sequence recomputes
    assert len(out.outputs[0].token_ids) == 8


def test_sampling_params_are_copied_at_submit(roomy):
    """Case 6: raising n after submit forked more sequences than were admitted."""
    engine = roomy.engine
    params = _greedy(4, n=1)
    engine.add_request("copied", [5, 6, 7], params)
    params.n = 4
    params.max_tokens = 9
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) == 4


def test_generation_config_eos_ids_stop_generation(model_dir, roomy, tmp_path):
    """Case 7: EOS ids listed only in generation_config.json were ignored."""
    prompt = [5, 6, 7]
    (free,) = roomy.generate([prompt], _greedy(12), use_tqdm=False)
    tokens = free.outputs[0].token_ids
    stop_at = next(
        i
        for i, t in enumerate(tokens)
        if i >= 2 and t not in tokens[:i] and 2 not in tokens[: i + 1]
    )
    eos = tokens[stop_at]
    shutil.copytree(model_dir, tmp_path / "m", dirs_exist_ok=True)
    config = tmp_path / "m" / "generation_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**data, "eos_token_id": [2, eos]}))
    llm = LLM(str(tmp_path / "m"), block_size=BLOCK, num_blocks=64, max_model_len=32)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[: stop_at + 1]
    assert out.outputs[0].finish_reason == "stop"
