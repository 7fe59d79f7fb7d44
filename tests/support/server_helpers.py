"""Helpers for the server tests: a tiny random Llama with a byte-level BPE tokenizer (every byte
one token, as GPT-2-style vocabularies spell them), a live uvicorn server on a free port, raw
HTTP calls, OpenAI-shaped error checks, SSE parsing and the /metrics gauges."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn
from hf_models import make_tiny_model

from pagedjax import LLM
from pagedjax.entrypoints.openai.logprobs import _bytes_to_unicode

KEY = "hardening-key"
MODEL = "tiny-bytes"
MAX_MODEL_LEN = 96
MAX_QUEUE = 8
BODY_TIMEOUT_S = 1.0
PROMPTS = ["Hello there", "caf\u00e9 au lait", "\U0001f600 smile", "abc"]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>"
BYTE_CHARS = _bytes_to_unicode()
SPECIALS = ("<s>", "</s>", "<pad>", "<extra>")


def save_byte_tokenizer(directory, chat_template: str) -> None:
    """Byte-level BPE with no merges: token b is byte b; 256 and 257 are <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {BYTE_CHARS[b]: b for b in range(256)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258, "<extra>": 259})
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    fast.chat_template = chat_template
    fast.save_pretrained(directory)


def make_byte_model(directory, chat_template: str = CHAT_TEMPLATE) -> None:
    make_tiny_model("llama_gqa", directory, vocab_size=260, bos_token_id=256, eos_token_id=257)
    save_byte_tokenizer(directory, chat_template)


def byte_llm(tmp_path_factory, name: str, **engine_args) -> LLM:
    """An LLM over a fresh byte model (8-token blocks, 200 of them, seed 0 unless given)."""
    path = tmp_path_factory.mktemp(name)
    make_byte_model(path)
    return LLM(str(path), **(dict(block_size=8, num_blocks=200, seed=0) | engine_args))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_text(client, model: str, prompt: str, max_tokens: int) -> str:
    """The text of one greedy completion stream (EOS ignored)."""
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
    return text


@contextlib.contextmanager
def live_server(app):
    """Serve ``app`` with uvicorn on a free loopback port; yields the base URL."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True  # uvicorn's graceful stop: open connections get to finish
        thread.join(timeout=30)
        if thread.is_alive():  # one still open: close it, and say so rather than leave it running
            srv.force_exit = True
            thread.join(timeout=10)
            raise AssertionError(f"the server on port {port} did not stop within 30 s")


def raw(base, method, path, body=None, key=KEY, timeout=60):
    """(status, body bytes) of one plain HTTP request; ``body`` is bytes or JSON-able."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def assert_openai_error(status, body, expect_status, param=None, contains=None) -> dict:
    assert status == expect_status, (status, body[:500])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


def sse_events(body: bytes) -> list:
    """The data of each server-sent event: parsed JSON, or the string '[DONE]'."""
    out = []
    for event in body.decode().split("\n\n"):
        if event:
            assert event.startswith("data: "), event
            data = event[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metrics(base, key=KEY) -> dict[str, float]:
    status, body = raw(base, "GET", "/metrics", key=key)
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(base, timeout=60, key=KEY) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base, key)
        idle = m["pagedjax_num_requests_running"] == 0 and m["pagedjax_num_requests_waiting"] == 0
        if idle and m["pagedjax_kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine never went idle: {m}"
        time.sleep(0.05)
