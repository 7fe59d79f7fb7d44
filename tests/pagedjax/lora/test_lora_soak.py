"""A mixed LoRA soak against a real ``pagedjax serve --engine-process`` (its parts in
tests/support/server_soak.py): four adapters and the base model under 32 concurrent greedy
streams (two waves of them) while one client loads, unloads and re-loads adapters at run time:
good ones (a served adapter's directory under new names), a truncated one, non-finite ones (a NaN in
lora_A, a lora_B that overflows once scaled) and paths outside the allowed root or missing.
Every normal stream's text equals its solo run, no good request gets a 5xx, each bad load is a
400 naming what is wrong, the server stays up and the KV pool returns to 0 blocks. Two device
slots and a host cache of four: adapters queue for slots and leave the host cache while the
streams run."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import threading

import pytest
from hf_models import make_tiny_model
from peft_adapters import save_random_adapter
from safetensors.numpy import load_file, save_file
from server_helpers import CHAT_TEMPLATE, free_port, raw, save_byte_tokenizer, sse_events, wait_idle
from server_soak import wait_healthy

pytestmark = pytest.mark.slow

KEY = "lora-soak-key"
ADAPTERS = ["a1", "a2", "a3", "a4"]
MODELS = ["base", *ADAPTERS]
PROMPTS = ["Hello there", "caf\u00e9 au lait", "abc def", "The cat sat."]
STREAMS = 32
TOKENS = 40
WAVES = 2  # of STREAMS concurrent streams each, the churn running through both
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make(root):
    """The base model, four good adapters, and broken ones: (base dir, {name: adapter dir})."""
    base = root / "base"
    hf = make_tiny_model("llama_gqa", base, vocab_size=260, bos_token_id=256, eos_token_id=257)
    save_byte_tokenizer(base, CHAT_TEMPLATE)
    allowed = root / "adapters"
    dirs = {}
    for i, name in enumerate(ADAPTERS, start=1):
        dirs[name] = allowed / name
        modules = ALL if i % 2 else ["q_proj", "v_proj", "down_proj"]
        save_random_adapter(hf, dirs[name], i, r=4 * i, lora_alpha=8, target_modules=modules)
    weights = "adapter_model.safetensors"
    for bad in ("truncated", "nan", "overflow"):
        shutil.copytree(dirs["a1"], allowed / bad)
        dirs[bad] = allowed / bad
    data = (dirs["truncated"] / weights).read_bytes()
    (dirs["truncated"] / weights).write_bytes(data[: len(data) // 3])
    for bad, which, value in (("nan", "lora_A", float("nan")), ("overflow", "lora_B", 3e38)):
        tensors = load_file(str(dirs[bad] / weights))
        key = sorted(k for k in tensors if f".{which}." in k)[0]
        tensors[key][:] = value
        save_file(tensors, str(dirs[bad] / weights))
    shutil.copytree(dirs["a2"], root / "outside")
    dirs["outside"] = root / "outside"
    return base, allowed, dirs


def _body(model: str, prompt: str) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def _stream(base: str, model: str, prompt: str) -> tuple[int, str]:
    status, reply = raw(base, "POST", "/v1/completions", _body(model, prompt), key=KEY, timeout=600)
    if status != 200:
        return status, reply.decode(errors="replace")[:300]
    events = sse_events(reply)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    return status, "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def _churn(base: str, dirs: dict, stop: threading.Event, seen: list) -> None:
    """Load, use, unload and re-load adapters until ``stop``: every answer recorded as
    (what, status, message)."""

    def load(name, path):
        status, reply = raw(
            base, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
            key=KEY, timeout=600,
        )  # fmt: skip
        message = json.loads(reply)["error"]["message"] if status != 200 else ""
        seen.append((f"load {name}", status, message))
        return status

    def unload(name):
        status, _ = raw(
            base, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, key=KEY, timeout=600
        )
        seen.append((f"unload {name}", status, ""))

    round_ = 0
    while not stop.is_set():
        round_ += 1
        good = f"x{round_}"
        if load(good, dirs["a3"]) == 200:  # a served adapter's directory, under a new name
            seen.append((f"use {good}", *_stream(base, good, PROMPTS[round_ % len(PROMPTS)])))
            unload(good)
        for bad in ("truncated", "nan", "overflow", "outside"):
            load(f"bad-{bad}-{round_}", dirs[bad])
        load(f"missing-{round_}", dirs["a1"].parent / "missing")


def test_adapters_loaded_unloaded_and_broken_while_32_streams_run(tmp_path):
    base_dir, allowed, dirs = _make(tmp_path)
    port = free_port()
    argv = [sys.executable, "-c", "from pagedjax.cli import main; main()", "serve"]
    argv += ["--model", str(base_dir), "--port", str(port), "--api-key", KEY]
    argv += ["--served-model-name", "base", "--block-size", "8", "--num-blocks", "400"]
    argv += ["--max-model-len", "96", "--max-num-seqs", "16", "--engine-process"]
    argv += ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "16"]
    argv += ["--enable-lora-runtime-updates", "--lora-allowed-roots", str(allowed)]
    argv += ["--lora-modules", *(f"{n}={dirs[n]}" for n in ADAPTERS)]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            base = wait_healthy(proc, port, log)
            keys = [(m, p) for m in MODELS for p in PROMPTS]
            solo = {k: _stream(base, *k) for k in keys}  # each alone
            assert all(s == 200 for s, _ in solo.values()), solo
            assert len({solo[(m, PROMPTS[0])][1] for m in MODELS}) == len(MODELS)  # adapters act
            work = [keys[i % len(keys)] for i in range(STREAMS)]
            stop, seen = threading.Event(), []
            churn = threading.Thread(target=_churn, args=(base, dirs, stop, seen))
            churn.start()
            mixed = []
            with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
                for _ in range(WAVES):
                    mixed += pool.map(lambda k: _stream(base, *k), work)
            stop.set()
            churn.join(timeout=600)
            idle = wait_idle(base, timeout=120, key=KEY)
            alive = proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    tail = log.read_text()[-3000:]
    assert alive, tail
    assert mixed == [solo[k] for k in work * WAVES]  # every text as alone, every status 200
    assert idle["pagedjax_kv_blocks_used"] == 0
    rounds = sum(what.startswith("load x") for what, _, _ in seen)
    assert rounds >= 1, seen
    print(f"{len(mixed)} streams; {rounds} load/unload rounds, {len(seen)} adapter calls")
    for what, status, message in seen:
        if what.startswith(("load x", "use x", "unload x")):
            assert status == 200, (what, status, message)
        elif "truncated" in what:
            assert status == 400 and "cannot be read" in message, (what, message)
        elif "nan" in what or "overflow" in what:
            assert status == 400 and "is not finite" in message, (what, message)
        else:  # outside the root, or missing: one message, the path aside
            assert status == 400 and "is not a LoRA adapter directory under" in message, message
