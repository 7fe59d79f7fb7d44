"""A server runs for days: `pagedjax serve` with the embedded SmolLM2 and a cold compilation cache
runs its whole background compile to 0 pending, then serves a mixed load (n > 1, logprobs,
prompt logprobs, penalties, grammars, a LoRA adapter, beams, odd lengths, streams) for
$PAGEDJAX_LONG_RUN_MINUTES (default 20) under the machine's vm.max_map_count. Every answer must
equal the same request's answer alone, and the server's memory mappings and RSS, sampled every
10 s, must plateau: the program set is bounded, so nothing grows with time or traffic."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
from peft_adapters import save_random_adapter
from server_helpers import free_port, metrics, raw, sse_events
from server_soak import wait_healthy

pytestmark = pytest.mark.slow

KEY = "long-run-key"
MODEL = "smollm2"
MINUTES = float(os.environ.get("PAGEDJAX_LONG_RUN_MINUTES", "20"))
CLIENTS = 8
SAMPLE_S = 10.0
WORDS = ["paged", "attention", "keeps", "the", "cache", "in", "blocks", "like", "virtual", "memory"]


def _prompt(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


def mix() -> list[tuple[str, dict]]:
    """(path, body) of each kind of request the load sends, every answer reproducible: greedy,
    or sampled under a seed (a request's tokens depend on its seed and logits alone)."""
    so = "structured_outputs"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    bodies = []
    for n, max_tokens in ((3, 7), (17, 13), (61, 29), (143, 11), (301, 5), (777, 3)):
        bodies.append(("/v1/completions", {"prompt": _prompt(n), "max_tokens": max_tokens}))
    bodies += [
        ("/v1/completions", {"prompt": _prompt(9), "max_tokens": 9, "n": 3, "temperature": 0.8,
                             "top_p": 0.9, "seed": 7}),
        ("/v1/completions", {"prompt": _prompt(23), "max_tokens": 11, "temperature": 1.0,
                             "top_k": 40, "seed": 3}),
        ("/v1/completions", {"prompt": _prompt(15), "max_tokens": 8, "logprobs": 5}),
        ("/v1/completions", {"prompt": _prompt(31), "max_tokens": 3, "echo": True,
                             "logprobs": 3}),
        ("/v1/completions", {"prompt": _prompt(19), "max_tokens": 15, "frequency_penalty": 0.6,
                             "presence_penalty": 0.4, "repetition_penalty": 1.2}),
        ("/v1/completions", {"prompt": "A person as JSON:", "max_tokens": 40,
                             so: {"json": schema}}),
        ("/v1/completions", {"prompt": "Pick a colour:", "max_tokens": 6,
                             so: {"choice": ["red", "green", "blue"]}}),
        ("/v1/completions", {"prompt": "A date:", "max_tokens": 12,
                             so: {"regex": r"\d{4}-\d{2}-\d{2}"}}),
        ("/v1/completions", {"model": "tone", "prompt": _prompt(27), "max_tokens": 9}),
        ("/v1/completions", {"model": "tone", "prompt": _prompt(5), "max_tokens": 7, "n": 2,
                             "temperature": 0.7, "seed": 11}),
        ("/v1/completions", {"prompt": _prompt(13), "max_tokens": 6, "n": 2,
                             "use_beam_search": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}],
                                  "max_tokens": 12, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": _prompt(40)}],
                                  "max_tokens": 9, "logprobs": True, "top_logprobs": 2}),
    ]  # fmt: skip
    defaults = {"model": MODEL, "temperature": 0.0, "ignore_eos": True}
    return [(path, {**defaults, **body}) for path, body in bodies]


def answer(base: str, path: str, body: dict) -> str:
    """The request's answer, reduced to what must not change: the texts (and token logprobs)."""
    status, reply = raw(base, "POST", path, body, key=KEY, timeout=600)
    assert status == 200, (status, reply[:500])
    if body.get("stream"):
        events = sse_events(reply)
        assert events[-1] == "[DONE]", events[-3:]
        return "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
        )
    choices = json.loads(reply)["choices"]
    return json.dumps([[c.get("text") or c.get("message"), c.get("logprobs")] for c in choices])


def _proc_figures(pid: int) -> tuple[int, int]:
    """(memory mappings, RSS bytes) of the process ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return maps, rss * 1024


class Sampler(threading.Thread):
    """Samples the server's memory mappings, RSS and pending background programs every 10 s."""

    def __init__(self, pid: int, base: str):
        super().__init__(daemon=True)
        self.pid, self.base = pid, base
        self.samples: list[tuple[float, int, int, float]] = []  # (time, maps, rss, pending)
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            maps, rss = _proc_figures(self.pid)
            pending = metrics(self.base, key=KEY).get("pagedjax_background_compile_pending", -1)
            self.samples.append((time.monotonic(), maps, rss, pending))
            self.stop.wait(SAMPLE_S)


def _make_adapter(directory) -> None:
    """A PEFT adapter of SmolLM2-135M's shapes (random weights: only its shapes must match)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    save_random_adapter(
        hf, directory, seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
    )


def test_serve_runs_its_whole_background_compile_then_a_long_mixed_load(tmp_path):
    _make_adapter(tmp_path / "tone")
    port = free_port()
    argv = [sys.executable, "-c", "from pagedjax.cli import main; main()", "serve"]
    argv += ["--port", str(port), "--api-key", KEY, "--served-model-name", MODEL]
    argv += ["--enable-lora", "--max-loras", "2"]
    argv += ["--max-lora-rank", "8", "--lora-modules", f"tone={tmp_path / 'tone'}"]
    env = {**os.environ, "PAGEDJAX_CACHE_DIR": str(tmp_path / "cold-cache")}
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = wait_healthy(proc, port, log_path, timeout=1200)  # a cold cache
        sampler = Sampler(proc.pid, base)
        sampler.start()
        deadline = time.monotonic() + 3600
        while metrics(base, key=KEY).get("pagedjax_background_compile_pending", 1) > 0:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the background compile did not finish"
            time.sleep(5)
        compiled = metrics(base, key=KEY)["pagedjax_background_compiled_programs"]
        bound = metrics(base, key=KEY)["pagedjax_program_bound"]
        bodies = mix()
        expected = [answer(base, path, body) for path, body in bodies]  # each alone
        load_start = time.monotonic()
        failures, counts = _load(base, bodies, expected, MINUTES * 60)
        sampler.stop.set()
        sampler.join()
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert not failures, failures[:5]
        final = metrics(base, key=KEY)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    load = [s for s in sampler.samples if s[0] >= load_start]
    assert len(load) >= MINUTES * 60 / SAMPLE_S * 0.8, len(load)
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    peak_maps = max(s[1] for s in sampler.samples)
    first, second = load[: len(load) // 2], load[len(load) // 2 :]
    report = {
        "minutes": MINUTES,
        "requests": sum(counts.values()),
        "program_bound": bound,
        "background_compiled": compiled,
        "peak_maps": peak_maps,
        "map_limit": limit,
        "maps_first_half_max": max(s[1] for s in first),
        "maps_second_half_max": max(s[1] for s in second),
        "rss_first_half_max_mb": max(s[2] for s in first) / 2**20,
        "rss_second_half_max_mb": max(s[2] for s in second) / 2**20,
        "evictions": final.get("pagedjax_executable_evictions", 0),
    }
    print("long run:", json.dumps(report))
    assert peak_maps < limit / 2
    # A plateau: the second half of the load holds no more than the first, within noise.
    assert report["maps_second_half_max"] <= report["maps_first_half_max"] * 1.02 + 50
    assert report["rss_second_half_max_mb"] <= report["rss_first_half_max_mb"] * 1.05 + 64
    assert min(counts.values()) > 0, counts


def _load(base: str, bodies, expected, seconds: float):
    """CLIENTS threads send random requests of the mix for ``seconds``; (failures, count per
    kind)."""
    failures: list[str] = []
    counts = {i: 0 for i in range(len(bodies))}
    stop = time.monotonic() + seconds

    def client(seed: int):
        rng = random.Random(seed)
        while time.monotonic() < stop and len(failures) < 20:
            i = rng.randrange(len(bodies))
            path, body = bodies[i]
            try:
                got = answer(base, path, body)
            except Exception as e:  # noqa: BLE001 (every failure is reported)
                failures.append(f"{body}: {e!r}")
                continue
            counts[i] += 1
            if got != expected[i]:
                failures.append(f"{body}: {got[:300]} != {expected[i][:300]}")

    threads = [threading.Thread(target=client, args=(s,)) for s in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures, counts
