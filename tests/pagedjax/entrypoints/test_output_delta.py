"""A request's outputs across the engine process's pipe as deltas (output_delta.py): every
output rebuilt equal to the engine's, and a long output's later steps cheap to send."""

from __future__ import annotations

import copy
import pickle

import pytest

from pagedjax.engine.hosting.output_delta import OutputDecoder, OutputDelta, OutputEncoder
from pagedjax.outputs import CompletionOutput, Logprob, RequestOutput


class FakeSeq:
    """A sequence as the engine's output processor keeps it: lists that only grow."""

    def __init__(self, index: int, k: int | None):
        self.index, self.k = index, k
        self.tokens: list[int] = []
        self.logprobs: list[dict] = []
        self.text = ""
        self.finish: str | None = None
        self.stop_reason = None

    def step(self, token: int) -> None:
        self.tokens.append(token)
        self.text += f"t{token} "
        if self.k is not None:
            self.logprobs.append(
                {token + j: Logprob(-0.5 * j, j + 1, f"t{token + j}") for j in range(self.k)}
            )

    def output(self) -> CompletionOutput:  # as OutputProcessor.make_output copies them
        logprobs = list(self.logprobs) if self.k is not None else None
        return CompletionOutput(
            self.index,
            self.text,
            list(self.tokens),
            -1.0 * len(self.tokens),
            logprobs,
            self.finish,
            self.stop_reason,
        )


def request_output(seqs, finished=False, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput(
        "r0", "the prompt", [1, 2, 3], [s.output() for s in seqs], finished, None, prompt_logprobs
    )


def round_trip(outputs: list[RequestOutput]) -> list:
    """Each output through an encoder, pickled as the pipe does, and a decoder: the payloads."""
    enc, dec = OutputEncoder(), OutputDecoder()
    payloads, decoded = [], []
    for out in outputs:
        payload = enc.encode(out)
        payloads.append(payload)
        decoded.append(dec.decode(pickle.loads(pickle.dumps(payload))))
    for want, got in zip(outputs, decoded, strict=True):
        assert got == want
    return payloads


def test_a_growing_output_crosses_whole_once_then_as_deltas():
    seq = FakeSeq(0, k=5)
    outputs = []
    for t in range(60):
        seq.step(t)
        outputs.append(copy.deepcopy(request_output([seq])) if t == 0 else request_output([seq]))
    seq.finish = "length"
    outputs.append(request_output([seq], finished=True))
    payloads = round_trip(outputs)
    assert isinstance(payloads[0], RequestOutput)
    assert all(isinstance(p, OutputDelta) for p in payloads[1:])
    last_delta, whole = len(pickle.dumps(payloads[59])), len(pickle.dumps(outputs[59]))
    assert last_delta * 10 < whole, (last_delta, whole)  # about one token's worth, not sixty


def test_text_cut_at_a_stop_string_and_tokens_that_do_not_extend_are_sent_whole():
    seq = FakeSeq(0, k=None)
    outputs = []
    for t in range(4):
        seq.step(t)
        outputs.append(request_output([seq]))
    seq.text, seq.finish, seq.stop_reason = "t0 t1", "stop", "t2"  # cut at the stop string
    outputs.append(request_output([seq], finished=True))
    payloads = round_trip(outputs)
    assert payloads[-1].completions[0].text_kept == 0
    beams = [request_output([seq]), request_output([seq])]
    beams[1].outputs[0].token_ids = [9, 8]  # a beam that replaced the last one
    assert isinstance(round_trip(beams)[1], RequestOutput)


def test_more_completions_after_the_first_token_and_prompt_logprobs_sent_once():
    first = FakeSeq(0, k=2)
    outputs = [request_output([first])]  # before its first token a request has one sequence
    seqs = [first, FakeSeq(1, k=2), FakeSeq(2, k=2)]
    scored = [None, {2: Logprob(-1.0, 1, "b")}, {3: Logprob(-2.0, 1, "c")}]
    for t in range(5):
        for s in seqs:
            s.step(10 * s.index + t)
        outputs.append(request_output(seqs, prompt_logprobs=scored))
    payloads = round_trip(outputs)
    assert isinstance(payloads[1], RequestOutput)  # three completions where there was one
    assert all(isinstance(p, OutputDelta) for p in payloads[2:])
    assert all(p.prompt_logprobs is None for p in payloads[2:])  # the same list: not resent


def test_each_decoded_output_is_a_new_object_and_a_delta_needs_its_first_output():
    seq = FakeSeq(0, k=1)
    enc, dec = OutputEncoder(), OutputDecoder()
    seq.step(1)
    first = dec.decode(enc.encode(request_output([seq])))
    seq.step(2)
    delta = enc.encode(request_output([seq]))
    second = dec.decode(delta)
    assert first.outputs[0].token_ids == [1] and second.outputs[0].token_ids == [1, 2]
    assert first.outputs[0].logprobs is not second.outputs[0].logprobs
    with pytest.raises(ValueError, match="'r0'"):
        OutputDecoder().decode(delta)


def test_prompt_logprobs_cross_as_arrays_and_are_named_on_the_receiving_side():
    import numpy as np

    from pagedjax.outputs import PromptLogprobsList

    n, k = 80, 20
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, n).tolist()
    arrays = (
        rng.normal(size=n).astype(np.float32),
        rng.integers(1, 50, n).astype(np.int32),
        rng.integers(0, 1000, (n, k)).astype(np.int32),
        np.sort(rng.normal(size=(n, k)).astype(np.float32))[:, ::-1],
    )
    engine_side = PromptLogprobsList(prompt, *arrays, token_text=lambda t: f"<{t}>")
    built = list(engine_side)  # read on the engine's side: built there
    assert built[0] is None and len(built) == n
    assert built[5][prompt[5]] == Logprob(float(arrays[0][5]), int(arrays[1][5]), f"<{prompt[5]}>")
    assert min(lp.rank for lp in built[5].values()) == 1

    wire = pickle.dumps(engine_side)
    assert len(wire) * 3 < len(pickle.dumps(built))
    api_side = pickle.loads(wire)
    assert api_side._entries is None  # four arrays crossed, not 1,600 Logprob objects
    assert api_side[5][prompt[5]].decoded_token is None  # not named until bound
    dec = OutputDecoder(token_text=lambda t: f"<{t}>")
    out = RequestOutput("r0", "p", prompt, [], True, None, api_side)
    assert dec.decode(out).prompt_logprobs == built  # named as the engine named them


def test_an_echoed_prompts_logprobs_read_from_the_arrays_equal_those_read_from_the_entries():
    import numpy as np

    from pagedjax.entrypoints.openai.logprobs import TokenStrings, prompt_completion_logprobs
    from pagedjax.outputs import PromptLogprobsList

    n, k = 40, 5
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 30, n).tolist()  # few ids: the prompt's own token often in the top
    top_ids = np.stack([rng.permutation(30)[:k] for _ in range(n)]).astype(np.int32)
    top_lps = np.sort(rng.normal(size=(n, k)).astype(np.float32))[:, ::-1].copy()
    top_lps[3, 2] = -np.inf  # floored at -9999 in JSON
    own = rng.normal(size=n).astype(np.float32)
    lazy = PromptLogprobsList(prompt, own, rng.integers(1, 30, n), top_ids, top_lps)
    strings = TokenStrings(None)  # a token's text is its id: texts never collide
    from_arrays = prompt_completion_logprobs(strings, prompt, lazy, k)
    # The same read from vLLM's list of Logprob dicts: the token's own, then the others of rank
    # at most k, floored at -9999.
    token_lps, tops = [], []
    for tid, entry in zip(prompt, list(lazy), strict=True):
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if t != tid and lp.rank <= k)
        pairs = [(tid, entry[tid].logprob)] + [(t, entry[t].logprob) for _, t in ranked]
        token_lps.append(max(pairs[0][1], -9999.0))
        tops.append({strings.text(t): max(lp, -9999.0) for t, lp in pairs})
    from_entries = {**from_arrays, "token_logprobs": token_lps, "top_logprobs": tops}
    assert from_arrays == from_entries
    assert list(from_arrays["top_logprobs"][3].values()).count(-9999.0) == 1
