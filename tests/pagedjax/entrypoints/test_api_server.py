"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import types

import numpy as np
import openai
import pytest
from fake_model import idle_stats
from hf_models import make_tiny_model, save_word_tokenizer
from server_helpers import live_server, metrics, raw, wait_idle

from pagedjax import LLM, SamplingParams
from pagedjax.config import EngineConfig
from pagedjax.engine.engine_lora import EngineLoRA
from pagedjax.entrypoints.api_server import EngineLoop, QueueFull, ServerLimits, build_app
from pagedjax.entrypoints.openai.app_options import AppOptions

KEY = "test-key"
MODEL = "tiny"
ALIAS = "tiny-alias"  # a second --served-model-name
MAX_MODEL_LEN = 96
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w10' if m['role'] == 'user' else 'w11' }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w12{% endif %}"
)
MESSAGES = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w7 w8 w9"}]


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        " ".join(f"w{t}" for t in rng.integers(3, 256, int(rng.integers(2, 12)))) for _ in range(n)
    ]


PROMPTS = _prompts(4)
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _no_eos(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("api_llama")
    make_tiny_model("llama_gqa", path)
    save_word_tokenizer(path, chat_template=CHAT_TEMPLATE)
    llm = LLM(str(path), block_size=8, num_blocks=200, max_model_len=MAX_MODEL_LEN, seed=0)
    # The offline oracle runs on the same engine before the server owns it.
    refs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    chat_ref = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
    long_refs = {
        n: [o.outputs[0].text for o in llm.generate(PROMPTS, _no_eos(n), use_tqdm=False)]
        for n in (10, 30)
    }
    limits = ServerLimits(max_queue=64, max_body_bytes=32 * 1024)
    app = build_app(
        EngineLoop(llm.engine, limits.max_queue),
        [MODEL, ALIAS],
        AppOptions(api_key=KEY, limits=limits),
    )
    with live_server(app) as base:
        yield types.SimpleNamespace(base=base, refs=refs, chat_ref=chat_ref, long_refs=long_refs)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _raw(server, method, path, body=None, key=KEY):
    """(status, body bytes) of one plain HTTP request."""
    return raw(server.base, method, path, body, key=key, timeout=30)


def _metrics(server) -> dict[str, float]:
    return metrics(server.base, key=KEY)


def _wait_idle(server, timeout=30) -> dict[str, float]:
    return wait_idle(server.base, timeout, key=KEY)


# ---- results match the offline API ----------------------------------------------------------


def test_completions_greedy_match_llm_generate(server, client):
    for prompt, ref in zip(PROMPTS, server.refs, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.model == MODEL
        assert r.choices[0].text == ref.outputs[0].text
        assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # A batch of prompts: one choice each, in order.
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in r.choices] == [ref.outputs[0].text for ref in server.refs]
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))


def test_chat_uses_the_template_and_matches_llm_chat(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == server.chat_ref.outputs[0].text
    assert r.usage.prompt_tokens == len(server.chat_ref.prompt_token_ids)


def test_streaming_gives_the_same_text(server, client):
    ref = server.refs[1].outputs[0]
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        server.chat_ref.outputs[0].text
    )
    assert chunks[-1].choices[0].finish_reason == server.chat_ref.outputs[0].finish_reason

    # On the wire: server-sent events ending in [DONE].
    status, body = _raw(
        server,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True},
    )
    events = [e for e in body.decode().split("\n\n") if e]
    assert status == 200 and all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_n2_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, n=2)
    a = client.completions.create(seed=7, **kwargs)
    b = client.completions.create(seed=7, **kwargs)
    c = client.completions.create(seed=8, **kwargs)
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    texts = [ch.text for ch in a.choices]
    assert texts == [ch.text for ch in b.choices]
    assert texts != [ch.text for ch in c.choices]
    # Streaming n=2 assembles the same two samples.
    got = {0: "", 1: ""}
    for chunk in client.completions.create(seed=7, stream=True, **kwargs):
        for ch in chunk.choices:
            got[ch.index] += ch.text
    assert [got[0], got[1]] == texts


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.tokens == r.choices[0].text.split()
    # text_offset: where each token starts in the text (its joining space included).
    text, ends = r.choices[0].text, [*lp.text_offset[1:], len(r.choices[0].text)]
    assert [text[a:b].strip() for a, b in zip(lp.text_offset, ends, strict=True)] == lp.tokens
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy picks the top one
        assert top[tok] == pytest.approx(chosen, abs=1e-5)

    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


# ---- the other endpoints, auth and errors ---------------------------------------------------


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert _raw(server, "GET", "/health", key=None) == (200, b"ok")
    assert _raw(server, "GET", "/metrics", key=None)[0] == 401  # behind the key
    status, body = _raw(server, "GET", "/metrics")
    text = body.decode()
    for name in (
        "pagedjax_num_requests_running",
        "pagedjax_num_requests_waiting",
        "pagedjax_num_requests_swapped",
        "pagedjax_kv_blocks_used",
        "pagedjax_num_preemptions_total",
        "pagedjax_prefix_cache_hit_rate",
        "pagedjax_prompt_tokens_total",
        "pagedjax_generation_tokens_total",
        "pagedjax_time_to_first_token_seconds_bucket",
        "pagedjax_time_per_output_token_seconds_count",
        "pagedjax_compilations_total",
        "pagedjax_compile_seconds_total",
        "pagedjax_engine_aborts_total",
        "pagedjax_token_padding_ratio",
        "pagedjax_attention_padding_ratio",
    ):
        assert re.search(rf"^{name}\S* \S+$", text, re.M), name
    m = _metrics(server)
    assert m["pagedjax_generation_tokens_total"] > 0
    assert m["pagedjax_time_to_first_token_seconds_count"] > 0
    assert m["pagedjax_token_padding_ratio"] >= 1.0  # padded rows per real one
    assert m["pagedjax_attention_padding_ratio"] >= 1.0


def test_missing_or_wrong_key_is_401(server):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="w5", max_tokens=2)
    status, body = _raw(server, "GET", "/v1/models", key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def _stream_texts(server, n, max_tokens, disconnect_after=None):
    """Run n streaming clients at once; returns their texts (None for the one that left)."""

    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=max_tokens if i else 80,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, chunks = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            chunks += 1
            if i == 0 and disconnect_after is not None and chunks >= disconnect_after:
                await stream.close()  # leave mid-stream
                return None
        return text

    async def main():
        client = openai.AsyncOpenAI(
            base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60
        )
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(n))), timeout=120
            )
        finally:
            await client.close()

    return asyncio.run(main())


def test_32_concurrent_streams_and_a_disconnect_frees_its_blocks(server):
    before = _metrics(server)
    texts = _stream_texts(server, 32, max_tokens=10, disconnect_after=2)
    assert texts[0] is None
    refs = server.long_refs[10]
    assert all(t == refs[i % len(PROMPTS)] for i, t in enumerate(texts) if i)
    after = _wait_idle(server)
    aborted = 'pagedjax_request_success_total{finished_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    assert after["pagedjax_kv_blocks_used"] == 0


def test_bad_requests_get_their_errors_while_others_stream(server, client):
    results = {}
    worker = threading.Thread(
        target=lambda: results.update(texts=_stream_texts(server, 4, max_tokens=30))
    )
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while _metrics(server)["pagedjax_num_requests_running"] == 0:  # the streams are flowing
            assert worker.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        status, body = _raw(server, "POST", "/v1/completions", b'{"model": "tiny", "prompt": ')
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=MODEL, prompt="w5", max_tokens="ten")
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=MODEL, prompt="w5", temperature=-1)
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="gpt-4", prompt="w5", max_tokens=2)
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="w5 " * MAX_MODEL_LEN, max_tokens=2)
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user"}] * 0)
        status, body = _raw(server, "POST", "/v1/completions", b" " * (64 * 1024))
        assert status == 413 and "error" in json.loads(body)
        assert _raw(server, "GET", "/v1/nothing")[0] == 404
        assert _metrics(server)["pagedjax_num_requests_running"] > 0  # still streaming
    finally:
        worker.join(timeout=150)
    assert not worker.is_alive()
    refs = server.long_refs[30]
    assert all(t == refs[i] for i, t in enumerate(results["texts"]) if i)
    assert results["texts"][0].startswith(refs[0])  # the 80-token one
    _wait_idle(server)


def test_a_full_waiting_queue_refuses():
    class _Engine:  # one request already waits
        config = EngineConfig(model="m")
        lora = EngineLoRA()  # off
        runner = None  # its compile counts are read only when /metrics is

        def get_stats(self):
            return idle_stats(num_requests_waiting=1)

        def has_unfinished_requests(self):
            return False

    loop = EngineLoop(_Engine(), max_queue=1)
    loop.start()
    try:
        (fut,) = loop.submit([("r", [5, 6], lambda item: None)], None)
        with pytest.raises(QueueFull):
            fut.result(timeout=10)
    finally:
        loop.stop()


def test_cli_has_serve(capsys):
    from pagedjax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--api-key" in out and "127.0.0.1" in out


def test_stop_strings_are_cut_the_same_way_when_streaming(server, client):
    ref = server.refs[0].outputs[0].text
    stop = " ".join(ref.split()[3:5])  # a two-word stop string, which streaming must hold back
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop" and stop not in whole.text
    assert whole.text == ref[: ref.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == whole.text


def test_served_model_aliases(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    r = client.completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert r.model == MODEL and r.choices[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt=PROMPTS[0], max_tokens=3)


def test_cli_scheduler_and_cache_flags_reach_the_engine(monkeypatch):
    """vLLM's scheduler and cache flags on ``serve``: given, they reach the engine's arguments;
    left out, they are EngineArgs' own defaults (LLM's too)."""
    from pagedjax import EngineArgs, cli

    seen = {}
    monkeypatch.setattr(cli, "_initialize_distributed", lambda args: True)
    monkeypatch.setattr(
        "pagedjax.entrypoints.api_server.serve",
        lambda engine_args, options: seen.update(engine_args.keywords()),
    )
    names = ("max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching")
    names += ("preemption_mode", "swap_space")
    assert cli.main(["serve"]) == 0
    defaults = EngineArgs().keywords()
    assert {k: seen[k] for k in names} == {k: defaults[k] for k in names}
    argv = ["serve", "--max-num-batched-tokens", "256", "--no-enable-chunked-prefill"]
    argv += ["--no-enable-prefix-caching", "--preemption-mode", "swap", "--swap-space", "0.5"]
    assert cli.main(argv) == 0
    assert {k: seen[k] for k in names} == dict(
        zip(names, (256, False, False, "swap", 0.5), strict=True)
    )
    with pytest.raises(SystemExit):
        cli.main(["serve", "--preemption-mode", "drop"])


def test_cli_serve_takes_the_model_as_vllm_serve_does(monkeypatch, capsys):
    """``pagedjax serve MODEL`` as ``vllm serve MODEL``, the same as ``--model MODEL``; both at
    once must agree."""
    from pagedjax import cli

    seen = []
    monkeypatch.setattr(cli, "_initialize_distributed", lambda args: True)
    monkeypatch.setattr(
        "pagedjax.entrypoints.api_server.serve",
        lambda engine_args, options: seen.append(engine_args.model),
    )
    assert cli.main(["serve", "some/model", "--port", "9"]) == 0
    assert cli.main(["serve", "--model", "some/model"]) == 0
    assert cli.main(["serve", "some/model", "--model", "some/model"]) == 0
    assert seen == ["some/model"] * 3
    with pytest.raises(SystemExit):
        cli.main(["serve", "one/model", "--model", "another/model"])
    assert "'one/model' and --model 'another/model'" in capsys.readouterr().err
