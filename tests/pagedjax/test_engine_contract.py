"""The engine's contracts, read from the source and checked on the objects: front ends code
against engine/client.py's EngineClient (nothing of an LLMEngine, no probing of what an engine
or a runner has), one module starts a serving engine, LoRA is one seam, and the runner is a
ModelRunner split by responsibility."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from fake_model import FakeRunner, fake_engine
from fastapi.testclient import TestClient
from pagedjax.models import lora as model_lora
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import param_shapes

from pagedjax.config import EngineConfig
from pagedjax.engine.client import EngineClient
from pagedjax.engine.hosting.engine_client import EngineProcess
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.openai.serving import build_app
from pagedjax.spec_decode.draft import DraftModelRunner
from pagedjax.worker.runner import Runner, RunnerConfig
from pagedjax.worker.runner_protocol import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pagedjax"


def _sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_nothing_probes_an_engine_or_a_runner_for_what_it_has():
    probes = (
        'getattr(engine, "lora_manager"',
        "isinstance(engine, RemoteEngine)",
        "hasattr(runner",
        "getattr(runner",
        "scheduler.lora =",  # the scheduler takes its LoRA admission in its constructor
        "lora_manager",  # one seam: the engine's ``lora`` (engine/engine_lora.py)
    )
    found = [f"{path}: {p}" for path, text in _sources().items() for p in probes if p in text]
    assert found == []


def _calls_prepare(tree: ast.AST) -> bool:
    """Whether the module calls the server start's ``prepare`` (``startup.prepare(...)``, or
    ``prepare(...)`` in startup.py itself or where it was imported by name)."""
    imported = any(
        isinstance(n, ast.ImportFrom)
        and (n.module or "").endswith("hosting.startup")
        and any(a.name == "prepare" for a in n.names)
        for n in ast.walk(tree)
    )
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        attribute = isinstance(f, ast.Attribute) and f.attr == "prepare"
        if attribute and isinstance(f.value, ast.Name) and f.value.id == "startup":
            return True
        if isinstance(f, ast.Name) and f.id == "prepare" and imported:
            return True
    return False


def test_one_module_starts_a_serving_engine():
    callers = {
        path
        for path, text in _sources().items()
        if _calls_prepare(ast.parse(text))
        or (path.endswith("hosting/startup.py") and re.search(r"\bprepare\(engine", text))
    }
    assert callers == {"pagedjax/engine/hosting/startup.py"}


def test_the_engine_names_lora_on_few_lines():
    text = (PACKAGE / "engine" / "llm_engine.py").read_text()
    lines = [line for line in text.splitlines() if "lora" in line.lower()]
    assert len(lines) <= 15, "\n".join(lines)


def test_the_runner_class_is_at_most_250_lines_and_inherits_nothing():
    source, _ = inspect.getsourcelines(Runner)
    assert len(source) <= 250
    assert Runner.__mro__ == (Runner, object)  # its LoRA slots are held (worker/lora.py)


def test_lora_limits_are_one_config():
    assert not hasattr(model_lora, "LoRAConfig")
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert "lora" in names and not names & {"enable_lora", "max_loras", "max_lora_rank"}


def _tiny_runner() -> Runner:
    config = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 2, 1, 16)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), param_shapes(config))
    return Runner(config, params, RunnerConfig(num_blocks=8, block_size=8, max_model_len=32))


def test_every_runner_the_engine_takes_is_a_model_runner():
    engine = fake_engine()
    assert isinstance(engine.runner, FakeRunner) and isinstance(engine.runner, ModelRunner)
    target, draft = _tiny_runner(), _tiny_runner()
    assert isinstance(target, ModelRunner)
    assert isinstance(DraftModelRunner(target, draft), ModelRunner)
    assert not isinstance(object(), ModelRunner)


class _InterfaceOnly(EngineClient):
    """An EngineClient that is nothing but the interface, over an in-thread host: whatever the
    app reads beyond it is an AttributeError."""

    def __init__(self, host: EngineLoop):
        self._host = host
        self.metrics = host.metrics

    tokenizer = property(lambda self: self._host.tokenizer)
    model_config = property(lambda self: self._host.model_config)
    config = property(lambda self: self._host.config)
    eos_token_ids = property(lambda self: self._host.eos_token_ids)
    default_sampling_params = property(lambda self: self._host.default_sampling_params)
    is_running = property(lambda self: self._host.is_running)

    def check_request(self, prompt_token_ids, params):
        self._host.check_request(prompt_token_ids, params)

    def compile_grammar(self, constraint):
        return self._host.compile_grammar(constraint)

    def submit(self, requests, params, lora_request=None, priority=0):
        return self._host.submit(requests, params, lora_request, priority)

    def abort(self, request_id):
        self._host.abort(request_id)

    def command(self, name, *args):
        return self._host.command(name, *args)

    def start(self):
        self._host.start()

    def stop(self):
        self._host.stop()

    def close(self):
        self._host.close()


def test_the_openai_app_serves_any_engine_client():
    assert issubclass(EngineLoop, EngineClient) and issubclass(EngineProcess, EngineClient)
    client = _InterfaceOnly(EngineLoop(fake_engine(max_model_len=64)))
    body = {"model": "m", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0}
    with TestClient(build_app(client, "m")) as http:
        assert http.get("/health").status_code == 200
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["m"]
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        too_long = http.post("/v1/completions", json={**body, "prompt": [3] * 80})
        assert too_long.status_code == 400 and "max_model_len" in too_long.text
        assert b"pagedjax_request_success_total" in http.get("/metrics").content
    assert not client.is_running
