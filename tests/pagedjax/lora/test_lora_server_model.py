"""LoRA in the OpenAI server over a real tiny Llama with PEFT adapters: the official client
selecting adapters by model name gets, text for text, what the offline LLM generates under the
same adapter; loading one adapter and unloading another while requests run loses nothing (every
request finishes with its own adapter's text)."""

from __future__ import annotations

import threading
import time

import numpy as np
import openai
import pytest
from lora_peft import build
from server_helpers import live_server, metrics, raw

from pagedjax import LLM, SamplingParams
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.lora.updates import LoRAUpdates

MAX_TOKENS = 24
OPTIONS = dict(block_size=8, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(base dir, adapter paths, each model name's offline texts for PROMPTS)."""
    base, _, loras = build("llama_gqa", tmp_path_factory.mktemp("lora_server"), num_adapters=3)
    llm = LLM(base, **OPTIONS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    texts = {}
    for name, lora in zip(["base", "one", "two", "three"], [None, *loras], strict=True):
        outs = llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)
        texts[name] = [o.outputs[0].text for o in outs]
    assert len({tuple(t) for t in texts.values()}) == 4  # each adapter changes the text
    return base, [lora.lora_path for lora in loras], texts


PROMPTS = [np.random.default_rng(i).integers(3, 256, 9 + i).tolist() for i in range(2)]


def complete(client, name: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> str:
    out = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def test_the_openai_client_gets_each_adapters_text(model):
    base, paths, texts = model
    llm = LLM(base, **OPTIONS)
    app = build_app(
        EngineLoop(llm.engine),
        "base",
        AppOptions(lora_modules=[("one", paths[0]), ("two", paths[1])]),
    )
    with live_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for name in ("one", "base", "two", "one"):
            got = [complete(client, name, p) for p in PROMPTS]
            assert got == texts[name], name
        for name in ("two", "base"):  # responses name the model they ran under, as vLLM's
            args = dict(model=name, prompt=PROMPTS[0], max_tokens=2, temperature=0)
            assert client.completions.create(**args).model == name
            assert {c.model for c in client.completions.create(**args, stream=True)} == {name}


def test_loading_and_unloading_while_requests_run_loses_nothing(model):
    """Requests under "one" and the base model run while "three" is loaded and "one" unloaded:
    the running ones finish under "one", a request under "three" gets its text."""
    base, paths, texts = model
    llm = LLM(base, **OPTIONS)
    fetch = llm.runner.fetch

    def slow_fetch(handle):  # steps that take a while: the requests are running when we act
        time.sleep(0.02)
        return fetch(handle)

    llm.runner.fetch = slow_fetch
    updates = LoRAUpdates(enabled=True)
    app = build_app(
        EngineLoop(llm.engine),
        "base",
        AppOptions(lora_modules=[("one", paths[0])], lora_updates=updates),
    )
    results = {}
    with live_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def run(key, name, prompt):
            results[key] = complete(client, name, prompt)

        jobs = [("one", 0), ("base", 1), ("one", 1), ("base", 0)]
        threads = [threading.Thread(target=run, args=(j, j[0], PROMPTS[j[1]])) for j in jobs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while metrics(url, None)["pagedjax_num_requests_running"] < len(jobs):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        load = {"lora_name": "three", "lora_path": paths[2]}
        assert raw(url, "POST", "/v1/load_lora_adapter", load, key=None)[0] == 200
        assert raw(url, "POST", "/v1/unload_lora_adapter", {"lora_name": "one"}, key=None)[0] == 200
        assert metrics(url, None)["pagedjax_num_requests_running"] == len(jobs)  # still running
        three = [complete(client, "three", p) for p in PROMPTS]
        for t in threads:
            t.join(timeout=120)
    assert three == texts["three"]
    assert results == {(n, i): texts[n][i] for n, i in jobs}
