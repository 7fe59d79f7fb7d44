"""vLLM's offline types, in and out: TextPrompt / TokensPrompt and plain dicts wherever a prompt
goes, beam_search's BeamSearchOutput.sequences, chat's rendered prompt on its outputs,
get_tokenizer, best_of (vLLM V0's) and get_metrics' Counter / Gauge / Histogram objects."""

from __future__ import annotations

import logging

import pytest
from hf_models import tiny_llama_dir

from pagedjax import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)
from pagedjax.metrics.reader import Counter, Gauge, Histogram
from pagedjax.outputs import RequestOutput

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """(LLM, the lines it logged while it started)."""
    path = tiny_llama_dir(tmp_path_factory, "vllm_offline_api", chat_template=TEMPLATE)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("pagedjax")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(path, block_size=8, num_blocks=128, max_model_len=96, max_num_seqs=8)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    yield llm, [r.getMessage() for r in records]
    llm.close()


@pytest.fixture(scope="module")
def llm(started):
    return started[0]


def test_llm_logs_each_phase_of_its_start(started):
    llm, lines = started
    assert [line.split()[0] for line in lines] == ["Loading", "Loaded", "Engine"]
    assert lines[0].startswith(f"Loading {llm.engine_args.model} (dtype=float32")
    assert "LlamaForCausalLM, 2 layers" in lines[1]
    assert lines[2].startswith("Engine ready: KV cache of 127 blocks x 8 tokens (float32)")


def test_every_prompt_form_reaches_the_engine(llm):
    ids = [5, 6, 7, 8]
    text = llm.get_tokenizer().decode(ids)
    forms = [
        text,
        {"prompt": text},
        TextPrompt(prompt=text),
        ids,
        {"prompt_token_ids": ids},
        TokensPrompt(prompt_token_ids=ids),
        TokensPrompt(prompt_token_ids=ids, prompt="the text they came from"),
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    from_text = llm.get_tokenizer()(text)["input_ids"]
    assert [o.prompt_token_ids for o in outs] == [from_text] * 3 + [ids] * 4
    assert [o.prompt for o in outs] == [text] * 3 + [None] * 3 + ["the text they came from"]
    assert len({tuple(o.outputs[0].token_ids) for o in outs[3:]}) == 1
    (one,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)  # one prompt
    assert one.outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_llm_engine_and_beam_search_take_dict_prompts(llm):
    engine = llm.engine
    engine.add_request("dict-prompt", {"prompt_token_ids": [5, 6, 7, 8]}, GREEDY)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    (final,) = finals
    assert final.prompt_token_ids == [5, 6, 7, 8]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    outs = llm.beam_search([{"prompt": "w5 w6"}, TokensPrompt(prompt_token_ids=[9, 10])], params)
    assert all(isinstance(o, BeamSearchOutput) for o in outs)
    for out in outs:
        assert len(out.sequences) == 2
        for seq, completion in zip(out.sequences, out.outputs, strict=True):
            # vLLM's: a beam's tokens and text include the prompt's
            assert seq.tokens == out.prompt_token_ids + completion.token_ids
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
            assert seq.cum_logprob == completion.cumulative_logprob
        assert out.sequences[0].cum_logprob >= out.sequences[1].cum_logprob or (
            len(out.sequences[0].tokens) != len(out.sequences[1].tokens)  # length penalty
        )


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt": 5}, "prompt must be a string"),
        ({"prompt_token_ids": "w5"}, "prompt_token_ids must be a list"),
        ({"prompt": "x", "multi_modal_data": {"image": 1}}, "'multi_modal_data'"),
        ({"prompt_embeds": [0.5]}, "embeddings"),
        ({"text": "x"}, "unknown prompt key 'text'"),
        ({}, "needs 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_malformed_prompts_are_refused_naming_the_key(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_outputs_carry_the_rendered_prompt(llm):
    conversation = [{"role": "user", "content": "w5 w6"}]
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == "user: w5 w6\nassistant:"
    assert (
        out.prompt_token_ids
        == llm.get_tokenizer()(out.prompt, add_special_tokens=False)["input_ids"]
    )


def test_best_of_returns_the_n_best_of_its_samples(llm):
    sample = dict(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    every = llm.generate([[5, 6, 7]], SamplingParams(n=4, **sample), use_tqdm=False)[0]
    best = llm.generate([[5, 6, 7]], SamplingParams(n=2, best_of=4, **sample), use_tqdm=False)
    want = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert len(best[0].outputs) == 2
    assert sorted(c.token_ids for c in best[0].outputs) == sorted(c.token_ids for c in want)
    with pytest.raises(ValueError, match="best_of must be None or an integer >= n=3"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="best_of greater than n cannot be streamed"):
        SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA)


def _metrics(llm) -> dict:
    return {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}


def test_get_metrics_reports_vllm_series(llm):
    before = _metrics(llm)
    outs: list[RequestOutput] = llm.generate(
        [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    after = _metrics(llm)

    def grew(key) -> float:
        if isinstance(after[key], Histogram):
            return after[key].count - before[key].count
        return after[key].value - before[key].value

    assert isinstance(after["vllm:num_requests_running", None], Gauge)
    assert after["vllm:num_requests_running", None].value == 0
    assert 0 <= after["vllm:kv_cache_usage_perc", None].value <= 1
    assert isinstance(after["vllm:prompt_tokens", None], Counter)
    assert grew(("vllm:prompt_tokens", None)) == 5
    assert grew(("vllm:generation_tokens", None)) == 8
    assert grew(("vllm:request_success", "length")) == 2
    assert grew(("vllm:request_success", "stop")) == 0
    e2e = after["vllm:e2e_request_latency_seconds", None]
    assert isinstance(e2e, Histogram) and grew(("vllm:e2e_request_latency_seconds", None)) == 2
    assert e2e.buckets["+Inf"] == e2e.count and e2e.sum > 0
    assert list(e2e.buckets.values()) == sorted(e2e.buckets.values())  # cumulative
    lengths, was = (
        after["vllm:request_prompt_tokens", None],
        before["vllm:request_prompt_tokens", None],
    )
    assert lengths.sum - was.sum == 5
    assert (lengths.buckets["2"] - was.buckets["2"], lengths.buckets["5"] - was.buckets["5"]) == (
        1,
        2,
    )
    assert grew(("vllm:time_to_first_token_seconds", None)) == 2
    assert {m.labels["model_name"] for m in after.values()} == {llm.engine_args.model}
    assert all(o.finished for o in outs)
