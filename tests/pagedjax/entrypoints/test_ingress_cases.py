"""The plain server against tests/support/ingress_cases.py: the body checks, CORS and HEAD that the
Ray Serve ingress must answer the same way (tests/pagedjax/entrypoints/serve_ray/test_serve_ray.py
runs the same cases there); and the ingress's own pieces that run without a cluster."""

from __future__ import annotations

import pytest
from fake_model import fake_engine
from ingress_cases import SERVER_KWARGS, check_all
from server_helpers import live_server

from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.serve_ray.prefix_key import block_hashes, prompt_text


def test_the_plain_server_answers_every_case():
    with live_server(
        build_app(EngineLoop(fake_engine()), "fake", AppOptions(**SERVER_KWARGS))
    ) as base:
        check_all(base, "fake")


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000, b'{"messages": ' + b"[" * 100_000, b"\xff\xfe{", b'"x"', b"", b"{"],
    ids=["deep", "deep messages", "not utf-8", "a string", "empty", "cut"],
)
def test_a_body_the_router_cannot_read_routes_without_a_prefix(body):
    """The ingress's routing key: what does not parse (a RecursionError included: a 500 on Ray
    where the server says 400) is no prefix, and the app answers the body itself."""
    assert block_hashes(prompt_text(body)) == []


def test_a_lone_surrogate_routes_by_its_hash():
    body = b'{"prompt": "\\ud800 x"}'
    assert len(block_hashes(prompt_text(body))) == 1  # hashed, not a UnicodeEncodeError
