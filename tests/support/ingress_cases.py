"""What a careless or hostile client sends, and what the server answers: the same cases run
against the plain server and the Ray Serve ingress (tests/pagedjax/entrypoints/
test_ingress_cases.py, tests/pagedjax/entrypoints/serve_ray/test_serve_ray.py), so that both
answer alike.

``SERVER_KWARGS`` are build_app's options both are served with: a small body limit and CORS
for one origin. Each case: (name, method, path, body bytes or None, headers, status, a check of
the reply (status, headers, body) or None)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from pagedjax.entrypoints.api_server import Cors
from pagedjax.entrypoints.openai.protocol import ServerLimits

ORIGIN = "http://ui.local"
MAX_BODY = 256 * 1024
SERVER_KWARGS = {"limits": ServerLimits(max_body_bytes=MAX_BODY), "cors": Cors([ORIGIN])}
JSON = {"Content-Type": "application/json"}
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}


def _deep_object(model: str) -> bytes:
    deep = {"model": model, "prompt": "x", "stream_options": {}}
    node = deep["stream_options"]
    for _ in range(40):
        node["a"] = node = {}
    return json.dumps(deep).encode()


def _error_says(text: str):
    return lambda status, headers, body: text in json.loads(body)["error"]["message"]


def cases(model: str) -> list[tuple]:
    prompt = {"model": model, "prompt": [3, 4, 5], "max_tokens": 1}
    return [
        ("nested 100k deep", "POST", "/v1/completions", b"[" * 100_000, JSON, 400,
         _error_says("nest")),
        ("an object 40 deep", "POST", "/v1/completions", _deep_object(model), JSON, 400, None),
        ("not JSON", "POST", "/v1/completions", b"\xff\xfe{", JSON, 400, None),
        ("a string", "POST", "/v1/completions", b'"a string"', JSON, 400,
         _error_says("JSON object")),
        ("a lone surrogate", "POST", "/v1/completions",
         b'{"model": "%s", "prompt": "\\ud800 x"}' % model.encode(), JSON, 400,
         _error_says("surrogate")),
        ("over the body limit", "POST", "/v1/completions",
         json.dumps(prompt | {"prompt": "x" * MAX_BODY}).encode(), JSON, 413, None),
        ("HEAD /health", "HEAD", "/health", None, {}, 200,
         lambda status, headers, body: body == b""),
        ("a CORS preflight", "OPTIONS", "/v1/completions", None, PREFLIGHT, 200,
         lambda status, headers, body: headers.get("access-control-allow-origin") == ORIGIN),
        ("a preflight from elsewhere", "OPTIONS", "/v1/completions", None,
         PREFLIGHT | {"Origin": "http://evil.local"}, 400, None),
        ("a CORS request", "POST", "/v1/completions", json.dumps(prompt).encode(),
         JSON | {"Origin": ORIGIN}, 200,
         lambda status, headers, body: headers.get("access-control-allow-origin") == ORIGIN),
    ]  # fmt: skip


def send(base: str, method: str, path: str, body, headers: dict):
    """(status, lower-cased headers, body) of one plain HTTP request."""
    req = urllib.request.Request(base + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def check_all(base: str, model: str) -> None:
    """Every case against the server at ``base``; an AssertionError names the first that fails."""
    for name, method, path, body, headers, status, check in cases(model):
        got = send(base, method, path, body, headers)
        assert got[0] == status, (name, got[0], got[2][:300])
        assert check is None or check(*got), (name, got[1], got[2][:300])
