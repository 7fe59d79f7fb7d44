"""Async scheduling (engine/step_loop.py): step N+1 is scheduled and dispatched before step N's
tokens reach the host. It must not change a single token: greedy and seeded outputs are those of
the synchronous engine (and of HF), a finished sequence's row scheduled ahead never reaches an
output, aborts and preemption work, no block leaks, and nothing compiles after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_model import EOS, fake_engine
from hf_models import random_prompts, tiny_llama_hf
from spec_fake import check_blocks, run

from pagedjax import LLM, BeamSearchParams, SamplingParams

BLOCK = 8


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    return random_prompts(n, seed, lo, hi, vocab=30)  # within the fake model's vocabulary


def _mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """Plain greedy and seeded rows (EOS stops them, the fake's EOS is frequent), stop token ids,
    logprobs, one n=2 request (overlapped once forked)."""
    rng = np.random.default_rng(seed)
    params = []
    for i in range(n):
        params.append(
            SamplingParams(
                max_tokens=int(rng.integers(1, 20)),
                temperature=0.0 if i % 3 else 0.9,
                seed=i if i % 3 == 0 else None,
                stop_token_ids=[int(rng.integers(3, 32))] if i % 4 == 1 else None,
                logprobs=2 if i % 5 == 2 else None,
                n=2 if i == 7 else 1,
            )
        )
    return params


def _tokens(outputs) -> dict[str, list]:
    return {
        r: [(c.token_ids, c.finish_reason) for c in o.outputs] for r, o in sorted(outputs.items())
    }


FAKE_VARIANTS = {
    "roomy_chunked": dict(num_blocks=64, max_num_batched_tokens=16, num_host_blocks=40),
    "small_pool_recompute": dict(num_blocks=14, max_model_len=48, num_host_blocks=40),
    "small_pool_swap": dict(
        num_blocks=14, max_model_len=48, num_host_blocks=40, preemption_mode="swap"
    ),
}


@pytest.mark.parametrize("variant", sorted(FAKE_VARIANTS))
def test_mixed_batch_same_tokens_with_and_without_overlap(variant):
    kwargs = FAKE_VARIANTS[variant]
    prompts, params = _prompts(12, seed=1), _mixed_params(12, seed=2)
    results, stats = {}, {}
    for overlap in (False, True):
        engine = fake_engine(seed=5, async_scheduling=overlap, **kwargs)
        results[overlap] = _tokens(run(engine, prompts, params))  # invariants after every step
        stats[overlap] = engine.get_stats()
    assert results[True] == results[False]
    assert stats[False].num_overlapped_steps == 0 and stats[True].num_overlapped_steps > 0
    if "small_pool" in variant:
        assert stats[True].num_preemptions > 0 and stats[False].num_preemptions > 0
    finish = [f for outs in results[True].values() for _, f in outs]
    assert "stop" in finish and "length" in finish  # EOS / stop ids and max_tokens both ended some
    for r, outs in results[True].items():
        p = params[int(r[1:])]
        for ids, _ in outs:
            assert len(ids) <= p.max_tokens and min(ids, default=0) >= 0
            assert EOS not in ids[:-1]  # nothing after a stop


def test_finished_sequences_row_is_dropped_and_its_block_reused():
    """A finishes (max_tokens=1) in step 0, but step 1 was scheduled with it (its row is dropped
    and its new block freed); B, admitted in step 2, gets that block. The fake model reads B's
    context back from the pool, so a stale write of A's after B's prompt would change B's token.
    (On a device, steps run in dispatch order, and each takes the pool the one before returned.)"""
    a, b = list(range(3, 11)), list(range(11, 27)) + list(range(3, 18))  # 1 and 4 blocks
    params = [SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=1)]
    want = {}
    for overlap in (False, True):
        engine = fake_engine(
            num_blocks=5,
            max_model_len=32,
            max_num_seqs=1,
            enable_prefix_caching=False,
            async_scheduling=overlap,
        )
        steps = []
        dispatch = engine.runner.dispatch

        def record(seqs, *args, steps=steps, dispatch=dispatch, **kwargs):
            steps.append([(list(s.token_ids), list(s.block_table)) for s in seqs])
            return dispatch(seqs, *args, **kwargs)

        engine.runner.dispatch = record
        outs = run(engine, [a, b], params)
        want[overlap] = _tokens(outs)
    assert want[True] == want[False]
    assert [len(ids) for ids, _ in want[True]["r0"]] == [1]
    # Step 1 ran A's discarded decode (a placeholder) in a new block; step 2 gave it to B.
    (a_decode,) = steps[1]
    assert a_decode[0][0] < 0
    stale_block = a_decode[1][-1]
    (b_prefill,) = steps[2]
    assert b_prefill[0] == b and stale_block in b_prefill[1]


def test_synchronous_while_the_profile_times_phases():
    prompts, params = _prompts(4, seed=6, lo=3), [SamplingParams(max_tokens=6, ignore_eos=True)]
    engine = fake_engine()
    engine.profile.enabled = True
    sync = run(fake_engine(async_scheduling=False), prompts, params * 4)
    assert _tokens(run(engine, prompts, params * 4)) == _tokens(sync)
    assert engine.get_stats().num_overlapped_steps == 0


def test_abort_mid_run():
    prompts, params = _prompts(6, seed=3, lo=5), [SamplingParams(max_tokens=15, ignore_eos=True)]
    params = params * 6
    sync = run(fake_engine(async_scheduling=False), prompts, params)
    engine = fake_engine()
    outs = run(engine, prompts, params, abort_at={"r1": 3, "r4": 6})  # checks leaks too
    assert "r1" not in outs and "r4" not in outs
    assert _tokens({r: outs[r] for r in outs}) == _tokens({r: sync[r] for r in outs})
    assert engine.get_stats().num_overlapped_steps > 0
    assert not engine.steps.has_outputs() and engine.steps.pending is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=8, presence_penalty=0.5, ignore_eos=True),
        BeamSearchParams(beam_width=2, max_tokens=8),
    ],
    ids=["repetition_penalty", "presence_penalty", "beams"],
)
def test_falls_back_where_it_must(params):
    prompts = _prompts(3, seed=4, lo=3)
    swap = dict(num_host_blocks=40)  # beams can only be preempted by swapping
    sync = run(fake_engine(async_scheduling=False, **swap), prompts, [params] * 3)
    engine = fake_engine(**swap)
    assert _tokens(run(engine, prompts, [params] * 3)) == _tokens(sync)
    assert engine.get_stats().num_overlapped_steps == 0
    check_blocks(engine)


# ---- the real tiny Llama ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_hf(tmp_path_factory, "async_tiny")


def _llm(path: str, overlap: bool, **kwargs) -> LLM:
    kwargs = dict(block_size=BLOCK, max_model_len=96, num_blocks=64) | kwargs
    return LLM(path, async_scheduling=overlap, **kwargs)


def test_llama_greedy_mixed_batch_same_with_and_without_overlap(tiny):
    """Stop strings, stop token ids, max_tokens, chunked prefill and preemption (a small pool)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(2, 40, 10)]
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    small = dict(num_blocks=20, max_num_batched_tokens=32, max_num_seqs=8)
    free = _llm(tiny[0], False, **small).generate(prompts, plain, use_tqdm=False)
    params = []
    for i, out in enumerate(free):  # stops taken from where the unstopped outputs go
        ids = out.outputs[0].token_ids
        words = out.outputs[0].text.split()
        stop = [" ".join(words[5:7])] if i % 3 == 0 else None
        stop_ids = [ids[9]] if i % 3 == 1 else None
        params.append(
            SamplingParams(
                max_tokens=int(rng.integers(1, 17)) if i % 3 == 2 else 16,
                temperature=0,
                ignore_eos=True,
                stop=stop,
                stop_token_ids=stop_ids,
            )
        )
    results = {}
    for overlap in (False, True):
        llm = _llm(tiny[0], overlap, **small)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[overlap] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
        stats = llm.get_stats()
        assert stats.num_preemptions > 0 and stats.num_blocks_used == 0
        assert (stats.num_overlapped_steps > 0) == overlap
        finish = {o.outputs[0].finish_reason for o in outs}
        assert finish == {"stop", "length"}
    assert results[True] == results[False]
    assert sum(len(ids) < 16 for ids, _ in results[True]) >= 6  # the stops cut most of them


def test_llama_greedy_matches_hf_with_overlap(tiny):
    path, hf = tiny
    prompts = _prompts(5, seed=8, lo=1, hi=24)
    llm = _llm(path, True)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist()
    assert llm.get_stats().num_overlapped_steps > 0


def test_llama_seeded_sampling_same_with_overlap_alone_or_batched(tiny):
    prompts = _prompts(4, seed=9, lo=3, hi=30)
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=40 + i) for i in range(4)
    ]
    batched = {}
    for overlap in (False, True):
        outs = _llm(tiny[0], overlap).generate(prompts, params, use_tqdm=False)
        batched[overlap] = [o.outputs[0].token_ids for o in outs]
    assert batched[True] == batched[False]
    llm = _llm(tiny[0], True)
    alone = [
        llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
        for p, q in zip(prompts[:2], params[:2], strict=True)
    ]
    assert alone == batched[True][:2]


def test_nothing_compiles_after_warmup_with_overlap(tiny):
    # 16 sequences: steps of the 8- and 16-sequence buckets follow each other, each step's
    # tokens at one width (worker/step_program.py).
    llm = _llm(
        tiny[0],
        True,
        max_num_seqs=16,
        max_num_batched_tokens=32,
        num_blocks=24,
        max_model_len=48,
        warmup=True,
    )
    warm = llm.get_stats().num_compilations
    prompts = _prompts(10, seed=10, lo=1, hi=30)
    params = [
        SamplingParams(max_tokens=int(n), temperature=0.7, seed=1)
        for n in np.random.default_rng(11).integers(1, 16, 10)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    stats = llm.get_stats()
    assert stats.num_overlapped_steps > 0
    assert stats.num_compilations == warm, "a program compiled after warm-up"


def test_fill_reads_the_step_befores_rows_inside_the_step_program():
    from pagedjax.core.in_flight import placeholder
    from pagedjax.worker.step_program import fill_tokens, fill_width, to_width

    assert fill_width(9) == 16 and fill_width(256) == 256
    prev = np.array([7, 8, 9, 10, 11, 12, 13, 14], np.int32)
    wide = np.asarray(to_width(prev, 16))
    assert wide.shape == (16,) and wide[:8].tolist() == prev.tolist() and not wide[8:].any()
    assert np.asarray(to_width(wide, 4)).tolist() == [7, 8, 9, 10]
    ids = np.array([3, placeholder(0), placeholder(7), 4, placeholder(2), 0, 0, 0], np.int32)
    assert np.asarray(fill_tokens(ids, wide)).tolist() == [3, 7, 14, 4, 9, 0, 0, 0]
    with pytest.raises(ValueError, match="row"):
        placeholder(-1)
