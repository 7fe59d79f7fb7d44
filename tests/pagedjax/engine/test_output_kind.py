"""RequestOutputKind (vLLM's): what the engine returns for a request at each step. DELTA outputs
add up to the CUMULATIVE one, never sending text a stop string later cuts; FINAL_ONLY returns
the finished output alone; LLM.generate asks for FINAL_ONLY on its own copy of the params."""

from __future__ import annotations

import dataclasses
import time

import pytest
from server_helpers import byte_llm

from pagedjax import BeamSearchParams, RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind
PROMPTS = [list(b"The quick brown fox "), list("caf\u00e9 \u5b57".encode()), list(b"abc")]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return byte_llm(tmp_path_factory, "output-kind")


def run(llm, params: list[SamplingParams]) -> dict[str, list]:
    """Every output the engine returns per request, step by step, until all have finished."""
    engine, seen = llm.engine, {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
        seen[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def add_up(deltas) -> dict:
    """The DELTA outputs of one request added up, per sample, as CUMULATIVE would hold them."""
    total = {}
    for out in deltas:
        for c in out.outputs:
            t = total.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": []})
            t["text"] += c.text
            t["token_ids"] += c.token_ids
            t["logprobs"] += c.logprobs or []
            t["finish_reason"], t["cumulative_logprob"] = c.finish_reason, c.cumulative_logprob
    return total


def whole(out) -> dict:
    return {
        c.index: {
            "text": c.text,
            "token_ids": c.token_ids,
            "logprobs": c.logprobs or [],
            "finish_reason": c.finish_reason,
            "cumulative_logprob": c.cumulative_logprob,
        }
        for c in out.outputs
    }


def with_kind(p: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return dataclasses.replace(p, output_kind=kind)


@pytest.mark.parametrize(
    "base",
    [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7, prompt_logprobs=1),
    ],
    ids=["greedy-logprobs", "n2-seeded-prompt-logprobs"],
)
def test_delta_outputs_add_up_to_the_cumulative_one(llm, base):
    cumulative = run(llm, [base] * 3)
    deltas = run(llm, [with_kind(base, DELTA)] * 3)
    for rid, outs in cumulative.items():
        assert add_up(deltas[rid]) == whole(outs[-1])
        assert deltas[rid][-1].finished and not any(o.finished for o in deltas[rid][:-1])
        # each delta is new: no token sent twice
        counts = [len(c.token_ids) for o in deltas[rid] for c in o.outputs]
        assert sum(counts) == sum(len(c.token_ids) for c in outs[-1].outputs)
        sent = [o.prompt_logprobs for o in deltas[rid] if o.prompt_logprobs is not None]
        if base.prompt_logprobs is None:
            assert sent == []
        else:  # once, whole
            assert len(sent) == 1 and list(sent[0]) == list(outs[-1].prompt_logprobs)


def test_delta_text_never_runs_past_a_stop_string(llm):
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    free = run(llm, [base] * 3)
    texts = [outs[-1].outputs[0].text for outs in free.values()]
    # a stop string for each request from the middle of its own text, and one it never writes
    stops = [[t[len(t) // 2 : len(t) // 2 + 3], "\x00never"] for t in texts]
    assert all(len(s[0]) == 3 for s in stops)
    params = [dataclasses.replace(base, stop=s) for s in stops]
    cumulative = run(llm, params)
    deltas = run(llm, [with_kind(p, DELTA) for p in params])
    for (rid, outs), stop in zip(cumulative.items(), stops, strict=True):
        final = outs[-1].outputs[0]
        assert final.finish_reason == "stop" and final.stop_reason == stop[0]
        sent = ""
        for out in deltas[rid]:
            sent += out.outputs[0].text
            assert final.text.startswith(sent)  # nothing sent that the stop string cut off
        assert sent == final.text
        assert deltas[rid][-1].outputs[0].stop_reason == stop[0]


def test_final_only_returns_the_finished_output_alone(llm):
    base = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    cumulative = run(llm, [base] * 3)
    final = run(llm, [with_kind(base, FINAL_ONLY)] * 3)
    for rid, outs in cumulative.items():
        assert len(outs) > 1 and len(final[rid]) == 1 and final[rid][0].finished
        assert whole(final[rid][0]) == whole(outs[-1])
    beams = BeamSearchParams(beam_width=2, max_tokens=6, output_kind=FINAL_ONLY)
    beam_outs = run(llm, [beams, BeamSearchParams(beam_width=2, max_tokens=6), beams])
    assert [len(beam_outs[r]) for r in ("r0", "r2")] == [1, 1]
    assert whole(beam_outs["r0"][0]) == whole(run(llm, [beams] * 3)["r0"][0])
    assert len(beam_outs["r1"]) > 1


def test_generate_reads_final_outputs_and_leaves_the_callers_params(llm, monkeypatch):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    made = []
    processor = llm.engine.request_table.output_processor
    make = processor.make_output
    monkeypatch.setattr(processor, "make_output", lambda req: made.append(1) or make(req))
    outs = llm.generate(PROMPTS, p, use_tqdm=False)
    assert len(made) == len(PROMPTS)  # one output per request: none at the steps between
    assert p.output_kind is CUMULATIVE
    monkeypatch.undo()
    stepped = run(llm, [p] * 3)
    assert [whole(o) for o in outs] == [whole(stepped[r][-1]) for r in ("r0", "r1", "r2")]


def test_outputs_carry_the_engines_first_token_time(llm):
    base = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    outs = run(llm, [base, with_kind(base, FINAL_ONLY), with_kind(base, DELTA)])
    for steps in outs.values():
        first = [o.metrics.first_token_time for o in steps if o.outputs[0].token_ids]
        m = steps[-1].metrics
        assert t0 <= m.arrival_time < m.first_token_time <= time.monotonic()
        assert first[0] == m.first_token_time  # stamped once, in the step of the first token


@pytest.mark.parametrize("kind", ["delta", 1, None])
def test_bad_output_kind_is_named(kind):
    with pytest.raises(ValueError, match=r"output_kind must be one of .*got"):
        SamplingParams(output_kind=kind)


def test_beam_search_takes_no_delta():
    with pytest.raises(ValueError, match=r"output_kind must be one of .*FINAL_ONLY, got"):
        BeamSearchParams(beam_width=2, max_tokens=4, output_kind=DELTA)
