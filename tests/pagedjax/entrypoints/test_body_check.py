"""Bodies over INLINE_BODY_BYTES are parsed and their constraint checked in a process of their
own (pagedjax/entrypoints/openai/body_check.py): the answers are the ones the server gives a
small body, refusals included, and a worker that dies costs only the bodies it held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
from server_helpers import assert_openai_error, byte_llm, live_server, raw

from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.offload import INLINE_BODY_BYTES

KEY = "body-check-key"
MODEL = "tiny-body-check"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = byte_llm(tmp_path_factory, "body_check_llama", max_model_len=96)
    app = build_app(EngineLoop(llm.engine), MODEL, AppOptions(api_key=KEY))
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base, checker=app.state.offload.checker)
    assert app.state.offload.checker.worker_pids() == []  # closed with the app


def send(server, path: str, body: dict, pad: int = 0):
    """POST ``body``, with ``pad`` spaces of JSON whitespace after it (the same request, a
    larger body)."""
    data = json.dumps({"model": MODEL, **body}).encode() + b" " * pad
    return raw(server.base, "POST", path, data, key=KEY)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CASES = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 8, "temperature": 0}),
    (
        "/v1/completions",
        {
            "prompt": "Hi",
            "max_tokens": 12,
            "temperature": 0,
            "structured_outputs": {"json": SCHEMA},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        },
    ),
    ("/v1/completions", {"prompt": "Hi", "bogus": 1}),  # unknown field
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}),  # bad value
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": "(a{1000}){1000}"}}),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"nope": 1}}),
    (
        "/v1/completions",
        {"prompt": "Hi", "response_format": {"type": "json_object"}, "structured_outputs": {}},
    ),
    ("/v1/completions", {"prompt": "Hi", "model": "no-such-model"}),
    (  # the model named before the constraint is checked
        "/v1/completions",
        {"prompt": "Hi", "model": "no-such-model", "structured_outputs": {"nope": 1}},
    ),
]


@pytest.mark.parametrize("path,body", CASES, ids=range(len(CASES)))
def test_a_large_body_gets_the_answer_a_small_one_gets(server, path, body):
    small = send(server, path, body)
    checked = server.checker.num_checked
    large = send(server, path, body, pad=INLINE_BODY_BYTES + 1)
    assert server.checker.num_checked == checked + 1  # it went through the worker
    assert large[0] == small[0], (small, large)
    if small[0] == 200:
        strip = lambda r: [c["text"] if "text" in c else c["message"] for c in r["choices"]]  # noqa: E731
        assert strip(json.loads(large[1])) == strip(json.loads(small[1]))
    else:
        assert json.loads(large[1]) == json.loads(small[1])


def test_bad_json_and_deep_refs_in_large_bodies_are_400s(server):
    data = b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 100_000
    assert_openai_error(*raw(server.base, "POST", "/v1/completions", data, key=KEY), 400)
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1500)}
    chain = {"$ref": "#/$defs/d0", "$defs": {**defs, "d1500": {"type": "integer"}}}
    status, reply = send(
        server, "/v1/completions", {"prompt": "Hi", "structured_outputs": {"json": chain}}
    )
    assert_openai_error(status, reply, 400, contains="over the limit of 100")


def test_a_dead_worker_costs_only_the_bodies_it_held(server):
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    assert send(server, "/v1/completions", body, pad=INLINE_BODY_BYTES + 1)[0] == 200
    (pid,) = server.checker.worker_pids()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # the pool sees its worker gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    status, reply = send(server, "/v1/completions", body, pad=INLINE_BODY_BYTES + 1)
    assert status == 200, reply  # a new worker took it
    assert server.checker.worker_pids() not in ([], [pid])


def test_a_worker_does_not_run_the_main_script_again(tmp_path):
    """A script that serves without an ``if __name__ == "__main__"`` guard: its worker must not
    run it again (a spawned process would, and start another server)."""
    marker, script = tmp_path / "runs", tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        f"open({str(marker)!r}, 'a').write('ran\\n')\n"
        "from pagedjax.entrypoints.openai.body_check import BodyChecker\n"
        "checker = BodyChecker()\n"
        "print(checker.start().result(timeout=120))\n"
        "checker.close()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.read_text() == "ran\n"
