"""SamplingParams(prompt_logprobs=k): every prompt token's logprob and the top k, equal to
log_softmax of transformers' logits over the prompt, through chunked prefill, prefix caching and
preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import make_tiny_model

from pagedjax import LLM, SamplingParams
from pagedjax.outputs import Logprob

K = 3
TOL = 1e-4
PROMPT_LENS = [1, 2, 7, 23, 40]  # 40 > the token budget: several chunks, some not the last


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt_lp_llama")
    hf = make_tiny_model("llama_gqa", path)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]
    refs = []
    for p in prompts:
        with torch.no_grad():
            refs.append(torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1).numpy())
    # A small token budget forces chunked prefill (chunks of at most 16 tokens).
    llm = LLM(
        str(path),
        block_size=8,
        num_blocks=64,
        max_model_len=96,
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        preemption_mode="recompute",
    )
    return llm, prompts, refs, hf


def check(out, prompt, ref, k=K):
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for j in range(1, len(prompt)):
        row, entry = ref[j - 1], lps[j]
        token = prompt[j]
        assert isinstance(entry[token], Logprob)
        assert abs(entry[token].logprob - row[token]) < TOL, (j, entry[token], row[token])
        assert abs(np.sort(row)[::-1][entry[token].rank - 1] - row[token]) < TOL  # its rank
        top = np.argsort(-row)[:k]
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= k)
        assert [t for _, t in ranked] == top.tolist(), j
        for t in top:
            assert abs(entry[int(t)].logprob - row[t]) < TOL
        assert set(entry) <= {token, *top.tolist()}


def test_prompt_logprobs_match_transformers_through_chunks(tiny):
    llm, prompts, refs, _ = tiny
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=K)
    # Mixed with requests that ask for nothing: those steps score only the rows asked for.
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate(
        [*prompts, *prompts[2:]], [params] * len(prompts) + [plain] * 3, use_tqdm=False
    )
    for out, p, ref in zip(outs, prompts, refs, strict=False):
        check(out, p, ref)
    assert all(o.prompt_logprobs is None for o in outs[len(prompts) :])
    # Generation is unchanged by scoring the prompt.
    assert [o.outputs[0].token_ids for o in outs[2 : len(prompts)]] == [
        o.outputs[0].token_ids for o in outs[len(prompts) :]
    ]
    assert llm.get_stats().num_blocks_used == 0


def test_a_cached_prefix_is_computed_again(tiny):
    llm, prompts, refs, _ = tiny
    long, ref = prompts[-1], refs[-1]
    plain = SamplingParams(max_tokens=2, temperature=0)
    llm.generate(long, plain, use_tqdm=False)  # its full blocks are now in the prefix cache
    hits = llm.get_stats().prefix_cache_hits
    llm.generate(long, plain, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits > hits  # the cache does serve this prompt
    for k in (0, K):
        params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k)
        check(llm.generate(long, params, use_tqdm=False)[0], long, ref, k)
        check(llm.generate(long, params, use_tqdm=False)[0], long, ref, k)  # twice


def test_preemption_by_recompute_keeps_them_whole(tiny):
    llm, _, _, hf = tiny
    rng = np.random.default_rng(1)
    # 7 sequences of 40 + 40 tokens need 70 blocks at once: the pool (63) preempts some.
    prompts = [rng.integers(3, 256, 40).tolist() for _ in range(7)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    before = llm.get_stats().num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > before
    for out, p in zip(outs, prompts, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1).numpy()
        check(out, p, ref, k=1)


def test_bad_prompt_logprobs():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_split_scores_hands_each_scheduled_sequence_its_rows():
    """The runner returns a step's scores per scheduled sequence (by index), not into requests."""
    from pagedjax.worker.input_batch import ScheduledSeq
    from pagedjax.worker.prompt_logprobs import PromptLogprobsOutput, PromptRows, split_scores

    seqs = [
        ScheduledSeq([5, 6, 7], 0, [1], [], PromptRows(0, 1, [6, 7])),
        ScheduledSeq([9], 4, [2], []),
        ScheduledSeq([3, 4], 2, [3], [], PromptRows(1, 4, [4])),
    ]
    n = 4  # 3 rows, then padding
    out = PromptLogprobsOutput(
        np.arange(n, dtype=np.float32),
        np.arange(n, dtype=np.int32) + 1,
        np.arange(2 * n, dtype=np.int32).reshape(n, 2),
        np.zeros((n, 2), np.float32),
    )
    scores = split_scores(seqs, out)
    assert [(s.seq_index, s.first_target) for s in scores] == [(0, 1), (2, 4)]
    assert scores[0].scores.logprobs.tolist() == [0.0, 1.0]
    assert scores[1].scores.ranks.tolist() == [3]


def test_chunks_cover_every_row_at_one_size_per_token_bucket():
    """A step's rows to score go to the score program in chunks of one size per token bucket,
    whatever their count, sequence by sequence, padded with row 0 and target 0."""
    from pagedjax.worker.input_batch import ScheduledSeq
    from pagedjax.worker.prompt_logprobs import CHUNK_ROWS, PromptRows, chunk_rows, chunks

    assert chunk_rows(16) == 16 and chunk_rows(4096) == CHUNK_ROWS
    seqs = [
        ScheduledSeq([5, 6, 7], 0, [1], [], PromptRows(0, 1, [6, 7])),
        ScheduledSeq([9], 4, [2], []),
        ScheduledSeq([3, 4], 2, [3], [], PromptRows(1, 4, [4])),
    ]
    assert chunks([seqs[1]], 32) == []
    ((rows, targets),) = chunks(seqs, 32)
    assert rows.tolist() == [0, 1, 5] + [0] * 29 and targets.tolist() == [6, 7, 4] + [0] * 29
    many = [ScheduledSeq([1] * 300, 0, [1], [], PromptRows(0, 1, list(range(300))))]
    parts = chunks(many, 512)
    assert [len(r) for r, _ in parts] == [CHUNK_ROWS, CHUNK_ROWS]
    assert np.concatenate([t for _, t in parts])[:300].tolist() == list(range(300))
