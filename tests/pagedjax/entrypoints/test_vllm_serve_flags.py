"""A ``vllm serve`` command line of the common flags starts ``pagedjax serve`` unchanged: each
flag parses to what vLLM means by it (or, meaning nothing here, is accepted and logged), and one
such command line starts a server that answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from server_helpers import free_port, make_byte_model, raw

from pagedjax import cli

KEY = "vllm-flags-key"


def _vllm_serve_line(model: str, port: int) -> list[str]:
    """What a vLLM user types, but for the model and the port."""
    return [
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny",
        "--dtype",
        "auto",
        "-tp",
        "1",
        "--max-model-len",
        "96",
        "--gpu-memory-utilization",
        "0.9",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
        "--enable-prefix-caching",
        "--swap-space",
        "1",
        "--seed",
        "0",
        "--trust-remote-code",
        "--enforce-eager",
        "--tokenizer",
        model,
        "--revision",
        "main",
        "--download-dir",
        "/tmp/pagedjax-test-downloads",
        "--load-format",
        "auto",
        "--max-logprobs",
        "5",
        "--hf-overrides",
        '{"rope_theta": 10000.0}',
        "--distributed-executor-backend",
        "mp",
        "--generation-config",
        "vllm",
        "--uvicorn-log-level",
        "info",
        "--enable-log-requests",
        "--root-path",
        "/api",
    ]


def test_a_vllm_serve_line_parses_to_vllms_meaning(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "_initialize_distributed", lambda args: True)
    monkeypatch.setattr(
        "pagedjax.entrypoints.api_server.serve",
        lambda engine_args, options: seen.update(engine=engine_args, server=options),
    )
    argv = _vllm_serve_line("org/model", 8123)
    argv += ["--disable-log-requests", "--disable-log-stats", "--max-log-len", "100"]
    argv += ["--limit-mm-per-prompt", '{"image": 0}', "--tokenizer-mode", "auto"]
    argv += ["--kv-cache-dtype", "auto", "--block-size", "16", "--enable-chunked-prefill"]
    assert cli.main(argv) == 0
    e, s = seen["engine"], seen["server"]
    assert (e.model, e.tokenizer, e.revision, e.dtype) == ("org/model", "org/model", "main", "auto")
    assert (e.tensor_parallel_size, e.max_model_len, e.max_num_seqs) == (1, 96, 4)
    assert (e.max_logprobs, e.hf_overrides, e.swap_space) == (5, {"rope_theta": 10000.0}, 1.0)
    assert (e.download_dir, e.load_format) == ("/tmp/pagedjax-test-downloads", "auto")
    assert (e.trust_remote_code, e.enforce_eager, e.disable_log_stats) == (True, True, True)
    assert (e.distributed_executor_backend, e.generation_config) == ("mp", "vllm")
    assert (s.host, s.port, s.api_key, s.served_model_name) == ("127.0.0.1", 8123, KEY, ["tiny"])
    assert (s.uvicorn_log_level, s.root_path, s.enable_log_requests) == ("info", "/api", True)
    assert s.max_log_len == 100


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_flags_model")
    make_byte_model(path)
    return str(path)


@pytest.mark.slow
def test_a_vllm_serve_line_starts_the_server(byte_model, tmp_path):
    """The whole start, as a user runs it (about a minute on a CPU: marked slow)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedjax.cli", *_vllm_serve_line(byte_model, port)]
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "no /health within 300 s"
                try:
                    with urllib.request.urlopen(base + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "logprobs": 5}
            status, reply = raw(base, "POST", "/v1/completions", body, key=KEY)
            assert status == 200, reply[:500]
            assert len(json.loads(reply)["choices"][0]["logprobs"]["tokens"]) == 4
            status, reply = raw(base, "POST", "/v1/completions", body | {"logprobs": 6}, key=KEY)
            assert status == 400 and b"max_logprobs=5" in reply  # --max-logprobs applies
        finally:
            proc.terminate()
            proc.wait(60)
    text = log_path.read_text()
    assert "enforce_eager=True has no effect in pagedjax" in text
    assert "trust_remote_code=True has no effect in pagedjax" in text
    assert re.search(r'Received request POST /api/v1/completions: \{"model": "tiny"', text)
