"""Hostile clients for the server soak (tests/pagedjax/entrypoints/test_server_soak.py), run in
processes of their own. Standard library only: a client process must start in milliseconds, not
import the engine, so that starting it costs the machine nothing while latencies are timed."""

from __future__ import annotations

import http.client
import json
import os
import time


def ready(_) -> int:
    """A no-op that tells which worker ran it (the soak starts every worker before timing)."""
    time.sleep(0.05)
    return os.getpid()


def send(port: int, key: str, path: str, body) -> int:
    """POST one body (bytes, or JSON-able) and read the whole reply: its HTTP status. The path
    "leave" is a client that reads the headers and one chunk of a stream, then goes away."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        conn.request("POST", "/v1/completions" if path == "leave" else path, data, headers)
        resp = conn.getresponse()
        if path == "leave":
            resp.read1(64)
        else:
            resp.read()
        return resp.status
    finally:
        conn.close()
