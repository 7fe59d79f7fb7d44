"""LoRA in the OpenAI server over the fake model: the serve flags, /v1/models with adapters,
the official client selecting an adapter by model name (checked on what the engine got), the
load/unload endpoints and their errors, loading and unloading while requests run, and the
per-adapter metrics."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from fake_model import fake_engine
from fastapi.testclient import TestClient
from lora_fakes import FakeLoRARunner, adapter_dir, lora_engine
from server_helpers import assert_openai_error, live_server, metrics, raw

from pagedjax import cli
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.lora.updates import LoRAUpdates

ONE = "/adapters/1/rank4"


class SlowLoRARunner(FakeLoRARunner):
    """Steps that take a while, so that requests are still running when the test acts."""

    def execute(self, seqs, num_top_logprobs: int = 0):
        time.sleep(0.01)
        return super().execute(seqs, num_top_logprobs)


def spy(engine) -> list:
    """Record the lora_request of every request the engine is given."""
    got, add = [], engine.add_request

    def add_request(request_id, prompt, params, lora_request=None):
        got.append(lora_request)
        return add(request_id, prompt, params, lora_request=lora_request)

    engine.add_request = add_request
    return got


def app_with_adapters(runner=FakeLoRARunner, updates=True, **kwargs):
    engine = lora_engine(runner=runner, max_loras=2, **kwargs)
    got = spy(engine)
    app = build_app(
        EngineLoop(engine),
        "base",
        AppOptions(lora_modules=[("one", ONE)], lora_updates=LoRAUpdates(enabled=updates)),
    )
    return app, engine, got


@pytest.fixture
def two(tmp_path) -> str:
    """A directory for adapter "two" (rank 8) that run-time loading accepts."""
    return adapter_dir(tmp_path, "2/rank8")


def test_adapters_are_listed_with_the_base_model_as_parent():
    app, engine, _ = app_with_adapters()
    with TestClient(app) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("one", "base")]
        assert cards[1]["root"] == ONE
        assert client.get("/v1/models/one").json()["parent"] == "base"
        assert client.get("/v1/models/two").status_code == 404
    assert engine.list_loras() == {1}


def test_the_openai_client_selects_an_adapter_by_model_name():
    app, _, got = app_with_adapters()
    with live_server(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="one", prompt=[5, 6, 7], max_tokens=3)
        assert len(out.choices) == 1 and out.usage.completion_tokens == 3
        client.completions.create(model="base", prompt=[5, 6, 7], max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="'three' does not exist"):
            client.completions.create(model="three", prompt=[5, 6, 7], max_tokens=2)
    assert [None if r is None else (r.lora_name, r.lora_int_id, r.lora_path) for r in got] == [
        ("one", 1, ONE),
        None,
    ]


def test_load_and_unload_endpoints_and_their_errors(two, tmp_path):
    TWO, rank16 = two, adapter_dir(tmp_path, "a/rank16")
    app, engine, got = app_with_adapters(max_lora_rank=8)
    with TestClient(app) as client:

        def post(path, body):
            r = client.post(path, json=body)
            return r.status_code, r.content

        status, body = post("/v1/load_lora_adapter", {"lora_name": "two", "lora_path": TWO})
        assert status == 200 and b"two" in body
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["base", "one", "two"]
        for bad, param, message in [
            ({"lora_name": "two", "lora_path": TWO}, "lora_name", "already been loaded"),
            ({"lora_name": "base", "lora_path": TWO}, "lora_name", "already been loaded"),
            ({"lora_name": "x", "lora_path": "/nowhere"}, "lora_path", "/nowhere"),
            ({"lora_name": "x", "lora_path": rank16}, "lora_path", "rank 16"),
            ({"lora_name": "x"}, "lora_path", "lora_path"),
            ({"lora_name": "x", "lora_path": TWO, "extra": 1}, "extra", "unknown field"),
        ]:
            assert_openai_error(*post("/v1/load_lora_adapter", bad), 400, param, message)
        err = assert_openai_error(
            *post("/v1/unload_lora_adapter", {"lora_name": "x"}), 404, "lora_name", "'x'"
        )
        assert err["code"] == "model_not_found"
        assert post("/v1/unload_lora_adapter", {"lora_name": "two"})[0] == 200
        gone = {"model": "two", "prompt": [1, 2], "max_tokens": 1}
        assert client.post("/v1/completions", json=gone).status_code == 404
        # a refused load leaves the name free
        status, _ = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": TWO})
        assert status == 200
    (x_id,) = engine.list_loras() - {1}
    assert x_id > 2  # ids are never reused: 2 was "two"


def test_without_enable_lora_there_are_no_adapters():
    app = build_app(EngineLoop(fake_engine()), "base")
    with TestClient(app) as client:
        body = {"lora_name": "one", "lora_path": ONE}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["base"]
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_app(EngineLoop(fake_engine()), "base", AppOptions(lora_modules=[("one", ONE)]))
    with pytest.raises(ValueError, match="/nowhere"):
        build_app(EngineLoop(lora_engine()), "base", AppOptions(lora_modules=[("one", "/nowhere")]))


def test_loading_and_unloading_while_requests_run_loses_nothing(two):
    TWO = two
    app, engine, _ = app_with_adapters(runner=SlowLoRARunner)
    results = {}
    with live_server(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)

        def complete(name: str, model: str):
            out = client.completions.create(
                model=model, prompt=[3, 4, 5], max_tokens=40, extra_body={"ignore_eos": True}
            )
            results[name] = (out.usage.completion_tokens, out.choices[0].finish_reason)

        threads = [
            threading.Thread(target=complete, args=(f"r{i}", m))
            for i, m in enumerate(["one", "base", "one"])
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while metrics(base, None)["pagedjax_num_requests_running"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        load = {"lora_name": "two", "lora_path": TWO}
        assert raw(base, "POST", "/v1/load_lora_adapter", load, key=None)[0] == 200
        unload = {"lora_name": "one"}
        assert raw(base, "POST", "/v1/unload_lora_adapter", unload, key=None)[0] == 200
        assert metrics(base, None)["pagedjax_num_requests_running"] == 3  # still running
        complete("after", "two")
        for t in threads:
            t.join(timeout=60)
        m = metrics(base, None)
    assert results == {name: (40, "length") for name in ("r0", "r1", "r2", "after")}
    assert m['pagedjax_lora_requests_total{lora_name="one"}'] == 2
    assert m['pagedjax_lora_generation_tokens_total{lora_name="one"}'] == 80
    assert m['pagedjax_lora_generation_tokens_total{lora_name="two"}'] == 40
    info = [k for k in m if k.startswith("pagedjax_lora_requests_info")]
    assert info == [
        'pagedjax_lora_requests_info{max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters=""}'
    ]


def test_serve_flags_reach_the_server(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "_initialize_distributed", lambda args: True)
    monkeypatch.setattr(
        "pagedjax.entrypoints.api_server.serve",
        lambda engine_args, options: seen.update(engine_args.keywords(), **vars(options)),
    )
    argv = ["serve", "--enable-lora", "--lora-modules", "a=/x", "b=/y/z", "--max-loras", "2"]
    argv += ["--max-lora-rank", "8", "--max-cpu-loras", "4"]
    assert cli.main(argv) == 0
    assert seen["lora_modules"] == [("a", "/x"), ("b", "/y/z")]
    assert (seen["enable_lora"], seen["max_loras"], seen["max_lora_rank"]) == (True, 2, 8)
    assert seen["max_cpu_loras"] == 4
    seen.clear()
    assert cli.main(["serve"]) == 0 and seen["enable_lora"] is False


def test_serve_flag_errors(capsys):
    assert cli.main(["serve", "--lora-modules", "a=/x"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--enable-lora", "--lora-modules", "no-path"])
    assert "name=path" in capsys.readouterr().err
