"""What the OpenAI app serves and how, beside its engine (``build_app``'s options): the API key
and the routes it leaves open, the server's limits, tool calling, LoRA adapters from the start
and at run time, the chat template, CORS. ``pagedjax serve``'s own options (api_server's
``ServeOptions``) extend them with the HTTP server's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagedjax.entrypoints.openai.protocol import ServerLimits
from pagedjax.entrypoints.openai.tools import ToolConfig
from pagedjax.lora.updates import LoRAUpdates


@dataclasses.dataclass(frozen=True)
class Cors:
    """Cross-origin requests from browsers (vLLM's --allowed-origins and friends): the origins
    allowed, the methods and headers, and whether credentials may be sent."""

    allow_origins: tuple[str, ...]
    allow_methods: tuple[str, ...] = ("*",)
    allow_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self):
        for name in ("allow_origins", "allow_methods", "allow_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (vLLM's): ValueError for a path
    that is no file."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError as e:
        raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a jinja template")


def check_api_key(api_key: str | None) -> None:
    """An empty key would turn authentication off without saying so: refuse it."""
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty; pass a key, or leave the option out to serve openly")


@dataclasses.dataclass(frozen=True)
class AppOptions:
    """With ``api_key`` every route but /health and /ping needs it, /metrics and the API docs
    too unless ``public_metrics`` / ``public_docs`` open them. ``limits``: per-request bounds.
    ``tool_config``: whether tool_choice "auto" is served, with which parser. With an engine of
    enable_lora, ``lora_modules`` ((name, path) pairs) are LoRA adapters that requests name as
    their ``model``; where ``lora_updates`` allows it (default: vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING), /v1/load_lora_adapter and /v1/unload_lora_adapter change
    them at run time (serving_models). ``chat_template`` (jinja) replaces the tokenizer's.
    ``cors``: the browser origins that may call the server (none unless given)."""

    api_key: str | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    public_metrics: bool = False
    public_docs: bool = False
    tool_config: ToolConfig | None = None
    lora_modules: list[tuple[str, str]] | None = None
    lora_updates: LoRAUpdates | None = None  # adapters loaded at run time, from where
    chat_template: str | None = None
    cors: Cors | None = None

    def __post_init__(self):
        check_api_key(self.api_key)
