"""vLLM's logging options: the periodic stats line (on unless --disable-log-stats) and
--enable-log-requests' line per request, body cut at --max-log-len."""

from __future__ import annotations

import logging

from fake_model import idle_stats
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedjax.engine.stats_log import StatsLog
from pagedjax.entrypoints.request_log import RequestLog
from pagedjax.outputs import EngineStats


def _stats(tokens: int, running: int) -> EngineStats:
    return idle_stats(
        num_blocks_total=100,
        num_blocks_used=25,
        num_blocks_peak=25,
        prefix_cache_hit_rate=0.5,
        num_requests_running=running,
        num_requests_waiting=3,
        num_generation_tokens=tokens,
    )


def test_the_stats_line_comes_once_per_interval(caplog):
    now = [0.0]
    log = StatsLog(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="pagedjax"):
        assert log.tick(_stats(0, 0)) is None  # the first call starts the clock
        now[0] = 4.0
        assert not log.due() and log.tick(_stats(100, 2)) is None
        now[0] = 10.0
        line = log.tick(_stats(200, 2))
    assert line == (
        "Avg generation throughput: 20.0 tokens/s, Running: 2 reqs, Swapped: 0 reqs, "
        "Waiting: 3 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%"
    )
    assert [r.getMessage() for r in caplog.records] == [line]


def test_requests_are_logged_with_their_body_cut(caplog):
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(body: dict):
        return body

    @app.get("/ping")
    async def ping():
        return {}

    with caplog.at_level(logging.INFO, logger="pagedjax"), TestClient(RequestLog(app, 12)) as c:
        assert c.post("/v1/echo", json={"prompt": "a long prompt"}).json() == {
            "prompt": "a long prompt"
        }
        assert c.get("/ping").status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("requests")]
    assert lines == ['Received request POST /v1/echo: {"prompt":"a', "Received request GET /ping"]
