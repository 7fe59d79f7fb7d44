"""vLLM's sampling extras on a tiny random Llama. min_tokens: before a sequence has min_tokens
tokens no EOS or stop token id is sampled and no stop string ends it; from then on they stop it as
ever. allowed_token_ids: nothing else is sampled. Greedy tokens equal transformers'
(``min_new_tokens``, ``prefix_allowed_tokens_fn``) with and without n-gram speculation (which
proposes nothing while stop ids are masked); seeded samples keep to the masks; stop strings wait;
the ids masked are EOS (unless ignored) and the stop ids. The text: the stop token id that ended a
sequence adds none, the stop string is cut, unless include_stop_str_in_output."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy, make_tiny_model, save_word_tokenizer, speculation_prompts

from pagedjax import LLM, SamplingParams
from pagedjax.core.scheduler import SeqChunk

MIN, MAX = 5, 16
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip
POOL = dict(block_size=8, max_model_len=64, num_blocks=40, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, torch model, prompts, each prompt's stop ids): greedy's 1st and 3rd tokens, so
    that without min_tokens every prompt would stop at once."""
    path = tmp_path_factory.mktemp("min_tokens_llama")
    hf = make_tiny_model("llama_gqa", path)
    save_word_tokenizer(path)
    prompts = speculation_prompts([3, 9, 17], seed=11)
    stops = [sorted({g[0], g[2]}) for g in hf_greedy(hf, prompts, 3)]
    return str(path), hf, prompts, stops


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], **POOL)


def _hf_min_new_tokens(hf, prompt, stops, allowed=None):
    kwargs = {} if allowed is None else {"prefix_allowed_tokens_fn": lambda *_: allowed}
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX,
            min_new_tokens=MIN,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=0,
            **kwargs,
        )
    return ids[0, len(prompt) :].tolist()


def _greedy(stops, min_tokens=MIN):
    return SamplingParams(
        max_tokens=MAX, temperature=0, ignore_eos=True, stop_token_ids=stops, min_tokens=min_tokens
    )


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_greedy_tokens_match_transformers_min_new_tokens(tiny, llm, speculate):
    path, hf, prompts, stops = tiny
    engine = LLM(path, speculative_config=SPEC, **POOL) if speculate else llm
    params = [_greedy(s) for s in stops]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, s, out in zip(prompts, stops, outs, strict=True):
        c = out.outputs[0]
        assert c.token_ids == _hf_min_new_tokens(hf, prompt, s)
        assert len(c.token_ids) >= MIN and not set(c.token_ids[:MIN]) & set(s)
    # not vacuous: without min_tokens each stops on its first token
    firsts = engine.generate(prompts, [_greedy(s, 0) for s in stops], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in firsts] == [1] * len(prompts)
    assert all(o.outputs[0].finish_reason == "stop" for o in firsts)
    if speculate:  # proposals resumed once min_tokens was reached
        assert engine.get_stats().spec_decoding.num_drafts > 0


def test_seeded_samples_never_stop_before_min_tokens(llm):
    stops = list(range(3, 67))  # a quarter of the vocabulary: most samples would stop early
    prompt = [[17, 40, 93, 7]]

    def lengths(min_tokens):
        p = SamplingParams(
            n=6,
            max_tokens=MAX,
            temperature=1.0,
            seed=7,
            stop_token_ids=stops,
            min_tokens=min_tokens,
        )
        out = llm.generate(prompt, p, use_tqdm=False)[0]
        for c in out.outputs:
            assert not set(c.token_ids[:min_tokens]) & set(stops)
        return [len(c.token_ids) for c in out.outputs]

    before, after = lengths(0), lengths(MIN)
    assert min(before) < MIN  # it would have stopped early
    assert min(after) > MIN and min(after) < MAX  # it stops, later


def test_stop_strings_wait_for_min_tokens(llm):
    prompt = [[17, 40, 93, 7, 250, 61]]
    plain = SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True)
    text = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].text
    first = text.split()[0]  # the first token's word: a stop string that ends it at once
    cut = llm.generate(prompt, SamplingParams(**_kw(plain), stop=[first]), use_tqdm=False)
    assert cut[0].outputs[0].token_ids == cut[0].outputs[0].token_ids[:1]
    late = SamplingParams(**_kw(plain), stop=[first], min_tokens=3)
    c = llm.generate(prompt, late, use_tqdm=False)[0].outputs[0]
    # found again only after 3 tokens, or never: then the whole text
    if c.finish_reason == "stop":
        assert len(c.token_ids) > 3 and c.stop_reason == first
        assert text.startswith(c.text) and len(c.text) > len(first)
    else:
        assert c.text == text


def _kw(p: SamplingParams) -> dict:
    return dict(max_tokens=p.max_tokens, temperature=p.temperature, ignore_eos=p.ignore_eos)


def test_the_masked_ids_are_eos_unless_ignored_and_the_stop_ids(llm):
    engine = llm.engine
    eos = set(engine.eos_token_ids)
    cases = {
        "a": (SamplingParams(min_tokens=2, stop_token_ids=[9]), eos | {9}),
        "b": (SamplingParams(min_tokens=2, stop_token_ids=[9], ignore_eos=True), {9}),
        "c": (SamplingParams(stop_token_ids=[9]), set()),
    }
    for rid, (params, want) in cases.items():
        engine.add_request(f"masked-{rid}", [5, 6, 7], params)
        assert set(engine.requests[f"masked-{rid}"].min_tokens_stops) == want
        engine.abort_request(f"masked-{rid}")


@pytest.mark.parametrize("bad", [-1, MAX + 1, 1.5, True])
def test_min_tokens_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=MAX, min_tokens=bad)


ALLOWED = [4, 9, 33, 57, 80, 101, 140, 166, 199, 230]  # the n-gram's prompt tokens mostly not


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_allowed_token_ids_greedy_match_transformers(tiny, llm, speculate):
    path, hf, prompts, stops = tiny
    engine = LLM(path, speculative_config=SPEC, **POOL) if speculate else llm
    # with min_tokens too: each prompt's first stop id is allowed, but not before MIN
    allowed = [sorted({*ALLOWED, s[0]}) for s in stops]
    params = [
        SamplingParams(**_kw(_greedy(s)), stop_token_ids=s, min_tokens=MIN, allowed_token_ids=a)
        for s, a in zip(stops, allowed, strict=True)
    ]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, s, a, out in zip(prompts, stops, allowed, outs, strict=True):
        ids = out.outputs[0].token_ids
        assert ids == _hf_min_new_tokens(hf, prompt, s, a)
        assert set(ids) <= set(a) and not set(ids[:MIN]) & set(s)


def test_seeded_samples_keep_to_allowed_token_ids(llm):
    p = SamplingParams(n=4, max_tokens=MAX, temperature=1.5, seed=1, allowed_token_ids=ALLOWED)
    out = llm.generate([[17, 40, 93]], p, use_tqdm=False)[0]
    seen = {t for c in out.outputs for t in c.token_ids}
    assert seen <= set(ALLOWED) and len(seen) > 3  # sampled, within the set


@pytest.mark.parametrize("bad", [[], [-1], [1.0], 5])
def test_bad_allowed_token_ids_are_refused(llm, bad):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids: token ids \\[256\\]"):
        llm.generate([[5]], SamplingParams(allowed_token_ids=[3, 256]), use_tqdm=False)


def _words(ids) -> str:
    return "".join(f" w{t}" for t in ids)  # the word tokenizer's text after a prompt


def _one(engine, prompt, **kw):
    return engine.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_the_stop_token_or_string_leaves_the_text_unless_asked(tiny, llm, speculate):
    path, _, prompts, _ = tiny
    engine = LLM(path, speculative_config=SPEC, **POOL) if speculate else llm
    plain = _kw(SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True))
    for prompt in prompts:
        ids = _one(engine, prompt, **plain).token_ids
        assert len(set(ids[:3])) == 3  # so the stops below are met at tokens 3 and 2
        # a stop token id (a plain word, not a special token): its word dropped, or kept
        dropped, kept = (
            _one(engine, prompt, **plain, stop_token_ids=[ids[2]], include_stop_str_in_output=k)
            for k in (False, True)
        )
        assert dropped.token_ids == kept.token_ids == ids[:3] and kept.stop_reason == ids[2]
        assert dropped.text == _words(ids[:2]) and kept.text == _words(ids[:3])
        # a stop string: cut before it, or kept
        stop = _words(ids[1:2]) + " "
        cut, whole = (
            _one(engine, prompt, **plain, stop=[stop], include_stop_str_in_output=k)
            for k in (False, True)
        )
        assert cut.text == _words(ids[:1]) and whole.text == _words(ids[:2]) + " "


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(llm):
    prompt = list(range(3, 43))  # 40 tokens
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate([prompt[-7:]], SamplingParams(**greedy), use_tqdm=False)[0]
    for k in (7, 40, 100):  # 40 and 100: nothing to cut
        p = SamplingParams(**greedy, truncate_prompt_tokens=k)
        out = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt[-k:]
        if k == 7:
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
    # -1: the last max_model_len (64) tokens, which leave no room to generate: refused by name
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([list(range(3, 103))], SamplingParams(truncate_prompt_tokens=-1))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_min_tokens_with_nothing_to_mask_changes_nothing(tiny, llm):
    """vLLM's benchmark clients send min_tokens with ignore_eos: no mask, no other program, and
    speculation proposes from the first token."""
    engine = llm.engine
    for rid, params, masked in [
        ("nothing", SamplingParams(min_tokens=4, ignore_eos=True), False),
        ("stop-id", SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=[9]), True),
        ("eos", SamplingParams(min_tokens=4), True),
    ]:
        engine.add_request(rid, [5, 6, 7], params)
        req = engine.requests[rid]
        (seq,) = req.group.get_seqs()
        (row,) = req.sampling_rows(SeqChunk(req.group, seq, 3), 256)
        assert (row.token_bitmask is not None) == masked, rid
        engine.abort_request(rid)
    path, _, _, _ = tiny
    spec = LLM(path, speculative_config=SPEC, **POOL)
    repeat = [[17, 40, 93, 7, 250, 61] * 4]
    p = SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, min_tokens=MAX)
    out = spec.generate(repeat, p, use_tqdm=False)[0]
    plain = llm.generate(repeat, SamplingParams(**_kw(p)), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.spec_decoding.num_drafts > 0
