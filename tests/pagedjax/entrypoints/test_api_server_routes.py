"""The routes are module-level handlers over ``app.state``: two apps in one process keep their
own engine loop, served names and API key (nothing of one app leaks into the other's answers)."""

from __future__ import annotations

from fake_model import fake_engine
from fastapi.testclient import TestClient

from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions


def _auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_two_apps_answer_with_their_own_names_keys_and_engine_loops():
    app_a = build_app(
        EngineLoop(fake_engine(max_model_len=64)), ["a", "a2"], AppOptions(api_key="key-a")
    )
    app_b = build_app(
        EngineLoop(fake_engine(max_model_len=48)),
        "b",
        AppOptions(api_key="key-b", public_metrics=True),
    )
    assert app_a.state.engine_client is not app_b.state.engine_client
    with TestClient(app_a) as a, TestClient(app_b) as b:
        assert a.get("/health").text == "ok" and b.get("/health").text == "ok"
        cards_a = a.get("/v1/models", headers=_auth("key-a")).json()["data"]
        cards_b = b.get("/v1/models", headers=_auth("key-b")).json()["data"]
        assert [(c["id"], c["max_model_len"]) for c in cards_a] == [("a", 64), ("a2", 64)]
        assert [(c["id"], c["max_model_len"]) for c in cards_b] == [("b", 48)]
        assert a.get("/v1/models", headers=_auth("key-b")).status_code == 401
        assert b.get("/v1/models", headers=_auth("key-a")).status_code == 401
        missing = b.get("/v1/models/a", headers=_auth("key-b"))
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert a.get("/metrics").status_code == 401  # only b opened its metrics
        assert b.get("/metrics").status_code == 200
        body = {"model": "a", "prompt": "x", "max_tokens": 1}
        wrong_model = b.post("/v1/completions", json=body, headers=_auth("key-b"))
        assert wrong_model.status_code == 404
    # each lifespan stopped its own engine thread
    assert not app_a.state.engine_client.is_running and not app_b.state.engine_client.is_running
