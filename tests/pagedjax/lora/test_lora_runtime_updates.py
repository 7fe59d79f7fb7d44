"""Run-time adapter loading is opt-in, as in vLLM (pagedjax/lora/updates.py): without
--enable-lora-runtime-updates or VLLM_ALLOW_RUNTIME_LORA_UPDATING the load and unload routes do
not exist; with them, an adapter path must be an adapter directory the server can read (under
--lora-allowed-roots when given), and every unusable path gets the same message; adapters are
read and checked on a reader thread while the engine steps, and installed between steps."""

from __future__ import annotations

import os
import threading
import time

import pytest
from fastapi.testclient import TestClient
from lora_fakes import FakeLoRARunner, adapter_dir, fake_loader, lora_engine
from server_helpers import live_server, metrics, raw

from pagedjax import cli
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.lora.updates import RUNTIME_UPDATES_ENV, LoRAUpdates

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def app(updates: LoRAUpdates | None = None, **engine):
    return build_app(
        EngineLoop(lora_engine(**({"max_loras": 2} | engine))),
        "base",
        AppOptions(lora_updates=updates),
    )


def test_the_load_and_unload_routes_exist_only_when_asked_for(tmp_path, monkeypatch):
    body = {"lora_name": "a", "lora_path": adapter_dir(tmp_path, "rank4")}
    monkeypatch.delenv(RUNTIME_UPDATES_ENV, raising=False)
    with TestClient(app()) as client:
        assert client.post(LOAD, json=body).status_code == 404
        assert client.post(UNLOAD, json={"lora_name": "a"}).status_code == 404
    for value in ("1", "True"):  # vLLM's switch
        monkeypatch.setenv(RUNTIME_UPDATES_ENV, value)
        with TestClient(app()) as client:
            assert client.post(LOAD, json=body).status_code == 200
    monkeypatch.setenv(RUNTIME_UPDATES_ENV, "0")
    with TestClient(app()) as client:
        assert client.post(LOAD, json=body).status_code == 404
    with TestClient(app(LoRAUpdates(enabled=True))) as client:
        assert client.post(LOAD, json=body).status_code == 200
        assert client.post(UNLOAD, json={"lora_name": "a"}).status_code == 200


def test_every_unusable_path_gets_one_message(tmp_path):
    """Missing, a file, an empty directory, a config without weights, outside the allowed
    root, a symbolic link out of it, a traversal out of it: one message, the path aside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    good = adapter_dir(root, "good/rank4")
    elsewhere = adapter_dir(outside, "x/rank4")
    (root / "file").write_text("{}")
    (root / "empty").mkdir()
    adapter_dir(root, "no_weights")
    os.remove(root / "no_weights" / "adapter_model.safetensors")
    os.symlink(elsewhere, root / "link")
    bad = [
        str(root / "missing"),
        str(root / "file"),
        str(root / "empty"),
        str(root / "no_weights"),
        elsewhere,
        str(root / "link"),
        str(root / ".." / "outside" / "x" / "rank4"),
        "/etc",
        "relative/nowhere",
    ]
    updates = LoRAUpdates(enabled=True, allowed_roots=(str(root),))
    with TestClient(app(updates)) as client:
        messages = set()
        for i, path in enumerate(bad):
            r = client.post(LOAD, json={"lora_name": f"x{i}", "lora_path": path})
            assert r.status_code == 400, path
            error = r.json()["error"]
            assert error["param"] == "lora_path" and repr(path) in error["message"]
            messages.add(error["message"].replace(repr(path), "PATH").replace(f"'x{i}'", "NAME"))
        assert len(messages) == 1, messages
        assert str(root) in messages.pop()  # the roots are the operator's own, given to clients
        r = client.post(LOAD, json={"lora_name": "good", "lora_path": good})
        assert r.status_code == 200
        names = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert names == ["base", "good"]


def test_updates_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="--lora-allowed-roots confines"):
        LoRAUpdates(enabled=False, allowed_roots=(str(tmp_path),))
    with pytest.raises(ValueError, match="'/no/such/root' is not a directory"):
        LoRAUpdates(enabled=True, allowed_roots=("/no/such/root",))
    with pytest.raises(ValueError, match="allowed_roots must be a list"):
        LoRAUpdates(enabled=True, allowed_roots=str(tmp_path))


def test_serve_flags(monkeypatch, capsys, tmp_path):
    seen = {}
    monkeypatch.delenv(RUNTIME_UPDATES_ENV, raising=False)
    monkeypatch.setattr(cli, "_initialize_distributed", lambda args: True)
    monkeypatch.setattr(
        "pagedjax.entrypoints.api_server.serve",
        lambda engine_args, options: seen.update(vars(options)),
    )
    assert cli.main(["serve", "--enable-lora"]) == 0
    assert seen["lora_updates"] == LoRAUpdates(enabled=False)
    argv = ["serve", "--enable-lora", "--enable-lora-runtime-updates"]
    assert cli.main([*argv, "--lora-allowed-roots", str(tmp_path)]) == 0
    assert seen["lora_updates"] == LoRAUpdates(True, (os.path.realpath(tmp_path),))
    assert cli.main(["serve", "--enable-lora-runtime-updates"]) == 2
    assert "--enable-lora-runtime-updates needs --enable-lora" in capsys.readouterr().err
    assert cli.main(["serve", "--enable-lora", "--lora-allowed-roots", str(tmp_path)]) == 2
    assert "--lora-allowed-roots confines" in capsys.readouterr().err


class GatedLoader:
    """fake_loader that records the thread of every read, and holds reads of paths under
    ``gated`` until ``release`` is set."""

    def __init__(self):
        self.threads: list[str] = []
        self.gated = "/gated/"
        self.release = threading.Event()

    def __call__(self, path, model_config, max_rank):
        self.threads.append(threading.current_thread().name)
        if self.gated in path:
            assert self.release.wait(30), "the test never released the read"
        return fake_loader(path, model_config, max_rank)


class SlowRunner(FakeLoRARunner):
    def execute(self, seqs, num_top_logprobs: int = 0):
        time.sleep(0.02)
        return super().execute(seqs, num_top_logprobs)


def test_adapters_are_read_off_the_engine_thread_while_requests_run(tmp_path):
    """A load whose read blocks does not stop a running request: it gains tokens while the
    read waits; the load then succeeds. Reads for /v1/load_lora_adapter and for a request
    naming an adapter that left the host cache run on the reader thread."""
    loader = GatedLoader()
    engine = lora_engine(runner=SlowRunner, loader=loader, max_loras=1, max_cpu_loras=1)
    server = build_app(
        EngineLoop(engine), "base", AppOptions(lora_updates=LoRAUpdates(enabled=True))
    )
    gated = adapter_dir(tmp_path, "gated/rank4")
    other = adapter_dir(tmp_path, "other/rank4")
    results = {}
    with live_server(server) as base:

        def complete(model, max_tokens):
            body = {"model": model, "prompt": [3, 4], "max_tokens": max_tokens}
            results[model] = raw(base, "POST", "/v1/completions", body | {"ignore_eos": True})

        runner = threading.Thread(target=complete, args=("base", 60))
        runner.start()
        deadline = time.monotonic() + 30
        while metrics(base, None)["pagedjax_num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        load = threading.Thread(
            target=lambda: results.update(
                load=raw(base, "POST", LOAD, {"lora_name": "g", "lora_path": gated}, key=None)
            )
        )
        load.start()
        while not loader.threads:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = metrics(base, None)["pagedjax_generation_tokens_total"]
        while metrics(base, None)["pagedjax_generation_tokens_total"] < before + 20:
            assert time.monotonic() < deadline, "the engine stopped while an adapter was read"
            time.sleep(0.01)
        assert "load" not in results
        loader.release.set()
        load.join(timeout=30)
        assert results["load"][0] == 200
        # "other" evicts "g" from the host cache (max_cpu_loras=1); a request for "g" re-reads it
        assert raw(base, "POST", LOAD, {"lora_name": "o", "lora_path": other}, key=None)[0] == 200
        complete("g", 2)
        runner.join(timeout=60)
    assert results["base"][0] == 200 and results["g"][0] == 200
    assert loader.threads == ["pagedjax-lora-read_0"] * 3
