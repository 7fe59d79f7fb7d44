"""Server options of vLLM's: --chat-template (a file or the template itself) in place of the
tokenizer's, and the cross-origin options (--allowed-origins and friends; none by default)."""

from __future__ import annotations

import pytest
from fake_model import fake_engine
from fastapi.testclient import TestClient
from server_helpers import CHAT_TEMPLATE, save_byte_tokenizer
from transformers import AutoTokenizer

from pagedjax import cli
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import Cors, build_app, load_chat_template
from pagedjax.entrypoints.openai.app_options import AppOptions

PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("byte_tokenizer")
    save_byte_tokenizer(path, CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(path)


def _engine_with(tokenizer):
    engine = fake_engine()  # a fake model; /tokenize needs only the tokenizer
    engine.tokenizer = tokenizer
    return engine


def _rendered(app) -> str:
    with TestClient(app) as client:
        r = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        return bytes(r.json()["tokens"]).decode()  # one token a byte


def test_chat_template_replaces_the_tokenizers(tokenizer, tmp_path):
    assert _rendered(build_app(EngineLoop(_engine_with(tokenizer)), "m")) == "<user>Hi>"
    assert (
        _rendered(
            build_app(EngineLoop(_engine_with(tokenizer)), "m", AppOptions(chat_template=PLAIN))
        )
        == "user: Hi\n"
    )
    assert tokenizer.chat_template == CHAT_TEMPLATE  # the engine's own is untouched
    file = tmp_path / "template.jinja"
    file.write_text(PLAIN)
    assert load_chat_template(str(file)) == PLAIN == load_chat_template(PLAIN)
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_cross_origin_requests_only_from_allowed_origins(tokenizer):
    preflight = {"Origin": "http://ui.local", "Access-Control-Request-Method": "POST"}
    with TestClient(
        build_app(EngineLoop(_engine_with(tokenizer)), "m", AppOptions(api_key="k"))
    ) as client:
        r = client.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers  # none by default
    cors = Cors(["http://ui.local"])
    with TestClient(
        build_app(EngineLoop(_engine_with(tokenizer)), "m", AppOptions(api_key="k", cors=cors))
    ) as client:
        r = client.options("/v1/completions", headers=preflight)  # no key in a preflight
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://ui.local"
        r = client.get("/v1/models", headers={"Origin": "http://ui.local"})
        assert r.status_code == 401  # the key is still needed
        assert r.headers["access-control-allow-origin"] == "http://ui.local"
        other = client.options("/v1/completions", headers=preflight | {"Origin": "http://x"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with pytest.raises(ValueError, match="allow_origins must be a list of strings"):
        Cors("http://ui.local")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--allowed-origins", "http://ui.local"], "not JSON"),
        (["--allowed-methods", '{"a": 1}'], "JSON list of strings"),
    ],
)
def test_cors_flags_are_checked_before_loading(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", *argv])
    assert message in capsys.readouterr().err


def test_serve_passes_the_options_on(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(cli, "_initialize_distributed", lambda args: True)
    monkeypatch.setattr(
        "pagedjax.entrypoints.api_server.serve",
        lambda engine_args, options: seen.update(vars(options)),
    )
    file = tmp_path / "t.jinja"
    file.write_text(PLAIN)
    argv = ["serve", "--chat-template", str(file), "--allowed-origins", '["*"]']
    assert cli.main([*argv, "--allow-credentials"]) == 0
    assert seen["chat_template"] == PLAIN
    assert seen["cors"] == Cors(("*",), ("*",), ("*",), True)
    assert cli.main(["serve"]) == 0
    assert seen["chat_template"] is None and seen["cors"] is None
    seen.clear()
    assert cli.main(["serve", "--chat-template", str(tmp_path / "nope.jinja")]) != 0
    assert "neither a file nor a jinja template" in capsys.readouterr().err and not seen
