"""allowed_token_ids with a grammar: an empty intersection with what the grammar allows first is
refused up front (ValueError offline, a 400 on the server, naming allowed_token_ids); one that
empties later ends the request with no token past it, finish "abort" and its error (never token
0, which neither allows). A tiny byte-level model: token b is byte b."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from server_helpers import make_byte_model

from pagedjax import LLM, SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.sampling_params import StructuredOutputsParams

A, B, X = ord("a"), ord("b"), ord("x")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("allowed_ids_grammar")
    make_byte_model(path)
    return LLM(str(path), block_size=8, num_blocks=64, max_model_len=64, seed=0)


def params(regex: str, allowed: list[int]) -> SamplingParams:
    so = StructuredOutputsParams(regex=regex)
    return SamplingParams(max_tokens=8, structured_outputs=so, allowed_token_ids=allowed)


def test_disjoint_from_the_first_step_is_refused_up_front(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids \[120\] and structured_outputs.regex"):
        llm.generate(["hi"], params("[a-c]+", [X]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(["hi"], params("[a-c]+", [X, B]), use_tqdm=False)  # one in common
    assert set(out.outputs[0].token_ids) <= {B, *llm.engine.model_config.eos_token_ids}
    with TestClient(build_app(EngineLoop(llm.engine), "m")) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, "allowed_token_ids": [X]}
        body["structured_outputs"] = {"regex": "[a-c]+"}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and "allowed_token_ids [120]" in r.json()["error"]["message"]


def test_an_intersection_that_empties_later_ends_the_request_with_no_token(llm):
    """ "ab" with only 'a' allowed: 'a', then nothing both allow: the request ends there, alone."""
    outs = llm.generate(
        ["hi", "yo"],
        [params("ab", [A]), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)],
        use_tqdm=False,
    )
    failed, other = outs
    assert failed.outputs[0].token_ids == [A] and failed.outputs[0].finish_reason == "abort"
    assert "allowed_token_ids and structured_outputs.regex have no token" in failed.error
    assert "after 1 output tokens" in failed.error
    assert other.error is None and len(other.outputs[0].token_ids) == 3
