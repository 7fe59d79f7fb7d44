"""Broken adapter directories as a careless operator or a hostile client leaves them (truncated
or garbage weights, malformed configs, wrong shapes, NaN or inf weights): every one is a
ValueError naming the path and the cause (models/lora.py ``load_adapter``), never a
reader's own exception: offline, at a server's start (--lora-modules) and on
/v1/load_lora_adapter (a 400, the server serving on)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from lora_peft import build
from pagedjax.models.loader import load_model
from pagedjax.models.lora import load_adapter
from safetensors.numpy import load_file, save_file

from pagedjax import LLM, LoRARequest
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.lora.updates import LoRAUpdates

CONFIG, WEIGHTS, BIN = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"


def _truncated(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[: len(data) // 2])


def _garbage(d: Path) -> None:
    (d / WEIGHTS).write_bytes(b"not a safetensors file" * 8)


def _config(value) -> callable:
    def write(d: Path) -> None:
        (d / CONFIG).write_text(value if isinstance(value, str) else json.dumps(value))

    return write


def _config_with(**changes) -> callable:
    def write(d: Path) -> None:
        (d / CONFIG).write_text(json.dumps(json.loads((d / CONFIG).read_text()) | changes))

    return write


def _one_dimensional_a(d: Path) -> None:
    tensors = load_file(str(d / WEIGHTS))
    key = sorted(k for k in tensors if ".lora_A." in k)[0]
    tensors[key] = tensors[key][0].copy()
    save_file(tensors, str(d / WEIGHTS))


def _set_first(which: str, value: float, everywhere: bool = False) -> callable:
    def write(d: Path) -> None:
        tensors = load_file(str(d / WEIGHTS))
        key = sorted(k for k in tensors if f".{which}." in k)[0]
        if everywhere:
            tensors[key][:] = value
        else:
            tensors[key][0, 0] = value
        save_file(tensors, str(d / WEIGHTS))

    return write


def _garbage_bin(d: Path) -> None:
    (d / WEIGHTS).unlink()
    (d / BIN).write_bytes(b"\x80\x04garbage, not a pickle" * 4)


# (name, how the copy is broken, what the message must say besides the path)
BROKEN = [
    ("truncated", _truncated, f"{WEIGHTS}' cannot be read: SafetensorError"),
    ("garbage", _garbage, f"{WEIGHTS}' cannot be read: SafetensorError"),
    ("config_list", _config([]), f"{CONFIG} must hold a JSON object, got list"),
    ("config_not_json", _config("{"), f"cannot read {CONFIG}"),
    ("r_null", _config_with(r=None), "r=None is not an integer >= 1"),
    ("r_text", _config_with(r="8"), "r='8' is not an integer >= 1"),
    ("alpha_object", _config_with(lora_alpha={}), r"lora_alpha=\{\} is not a finite number"),
    ("a_1d", _one_dimensional_a, r"lora_A.weight' has shape \(\d+,\)"),
    ("garbage_bin", _garbage_bin, f"{BIN}' cannot be read"),
    ("nan_a", _set_first("lora_A", float("nan")), r"lora_A.weight' is not finite"),
    ("inf_b", _set_first("lora_B", float("-inf")), r"lora_B.weight' is not finite"),
    ("overflow_b", _set_first("lora_B", 3e38, True), "not finite after scaling by lora_alpha"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama, one good PEFT adapter, and a broken copy of it per case in BROKEN."""
    root = tmp_path_factory.mktemp("lora_broken")
    base, _, loras = build("llama_gqa", root, num_adapters=1)
    broken = {}
    for name, breaks, _ in BROKEN:
        shutil.copytree(loras[0].lora_path, root / name)
        breaks(root / name)
        broken[name] = str(root / name)
    return base, loras[0], broken, load_model(base, "float32", use_cache=False).config


@pytest.mark.parametrize("name,message", [(n, m) for n, _, m in BROKEN])
def test_a_broken_adapter_is_a_value_error_naming_path_and_cause(tiny, name, message):
    _, _, broken, config = tiny
    with pytest.raises(ValueError, match=message) as e:
        load_adapter(broken[name], config, 16)
    assert broken[name] in str(e.value)


def test_broken_adapters_offline_at_start_and_at_run_time(tiny):
    """Offline and at a server's start, a ValueError naming the path; on
    /v1/load_lora_adapter a 400 naming the adapter, the path and the cause, the server serving
    the base model and its good adapters on."""
    base, good, broken, _ = tiny
    llm = LLM(base, block_size=8, max_model_len=64, enable_lora=True, max_lora_rank=16)
    for i, path in enumerate(broken.values(), start=10):
        with pytest.raises(ValueError, match=path):
            llm.add_lora(LoRARequest(f"bad{i}", i, path))
    assert llm.list_loras() == set()
    with pytest.raises(ValueError, match=f"--lora-modules bad={broken['truncated']}.*Safetensor"):
        build_app(
            EngineLoop(llm.engine),
            "base",
            AppOptions(lora_modules=[("ok", good.lora_path), ("bad", broken["truncated"])]),
        )
    updates = LoRAUpdates(enabled=True)
    app = build_app(
        EngineLoop(llm.engine),
        "base",
        AppOptions(lora_modules=[("ok", good.lora_path)], lora_updates=updates),
    )
    messages = {n: m for n, _, m in BROKEN}
    with TestClient(app) as client:
        for name, path in broken.items():
            r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["param"] == "lora_path" and f"LoRA adapter {name!r}" in error["message"]
            assert path in error["message"] and re.search(messages[name], error["message"])
        body = {"lora_name": "good", "lora_path": good.lora_path}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
        for model in ("base", "ok", "good"):
            out = client.post(
                "/v1/completions", json={"model": model, "prompt": [5, 6], "max_tokens": 2}
            )
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
        models = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert models == ["base", "ok", "good"]
