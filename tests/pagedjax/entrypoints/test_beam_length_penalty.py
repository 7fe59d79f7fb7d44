"""Beam search with any finite length_penalty is served (scores ranked in log space,
pagedjax/core/beam_search.py): ``length ** 1100`` overflowed a float, a 500."""

from __future__ import annotations

from fake_model import fake_engine
from fastapi.testclient import TestClient

from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app


def test_beam_search_with_a_huge_length_penalty_is_served():
    engine = fake_engine(num_host_blocks=16)
    app = build_app(EngineLoop(engine), "fake")
    body = {"model": "fake", "prompt": [3, 4, 5], "max_tokens": 4, "n": 2}
    with TestClient(app) as client:
        for penalty in (1100, -1100, 1e300):
            extra = {"use_beam_search": True, "length_penalty": penalty}
            r = client.post("/v1/completions", json=body | extra)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 2
