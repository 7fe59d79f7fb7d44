"""The FastAPI app: /v1/completions, /v1/chat/completions (both streaming as server-sent events),
/v1/models, vLLM's /tokenize, /detokenize and /version, /health (and /ping), Prometheus /metrics
and the API docs.

A request is validated whole (protocol), every prompt passes the engine's admission check, and
only then is anything submitted to the engine thread (engine_loop). build_app puts the shared
objects on ``app.state`` (app_state) and includes the routers (routes), whose module-level
handlers read them from there. Generation and streaming are in serving_engine; metrics in
metrics. Handlers reach the engine only through the engine loop.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedjax.engine.hosting.engine_client import RemoteEngine
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.openai import app_state
from pagedjax.entrypoints.openai.offload import Offload
from pagedjax.entrypoints.openai.protocol import APIError, ServerLimits, error_response
from pagedjax.entrypoints.openai.routes import ROUTERS, lora_router
from pagedjax.entrypoints.openai.serving_engine import OpenAIServing
from pagedjax.entrypoints.openai.serving_models import ServedModels
from pagedjax.entrypoints.openai.tools import ToolConfig
from pagedjax.lora.updates import LoRAUpdates

logger = logging.getLogger("pagedjax.api_server")


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


def build_app(
    engine,
    served_model_name: str | list[str],
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    *,
    public_metrics: bool = False,
    public_docs: bool = False,
    tool_config: ToolConfig | None = None,
    lora_modules: list[tuple[str, str]] | None = None,
    lora_updates: LoRAUpdates | None = None,
    chat_template: str | None = None,
    cors: Cors | None = None,
) -> FastAPI:
    """The FastAPI app over ``engine``; the engine thread starts and stops with the app.

    ``served_model_name`` is the model id, or several aliases: requests may name any of them,
    /v1/models lists them all, responses carry the first. With ``api_key`` every route but
    /health and /ping needs it, /metrics and the API docs too unless ``public_metrics`` /
    ``public_docs`` open them. ``tool_config``: whether tool_choice "auto" is served, with
    which parser. With an engine of enable_lora, ``lora_modules`` ((name, path) pairs) are
    LoRA adapters that requests name as their ``model``; where ``lora_updates`` allows it
    (default: vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), /v1/load_lora_adapter and
    /v1/unload_lora_adapter change them at run time (serving_models). ``chat_template``
    (jinja) replaces the tokenizer's. ``cors``: the browser origins that may call the server
    (none unless given).
    """
    check_api_key(api_key)
    model_names = (
        [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    )
    if not model_names or not all(isinstance(n, str) and n for n in model_names):
        raise ValueError(f"served model names must be non-empty strings, got {model_names!r}")
    limits = limits or ServerLimits()
    updates = lora_updates or LoRAUpdates.from_options()  # default: vLLM's environment variable
    models = ServedModels.for_engine(engine, model_names, lora_modules, updates)  # before the loop
    if isinstance(engine, RemoteEngine):  # an engine in another process: its loop's stand-in
        engine_loop = engine.engine_loop
    else:
        engine_loop = EngineLoop(engine, max_queue=limits.max_queue)
    if models.enable_lora:
        engine_loop.metrics.max_loras = engine.config.lora.max_loras
    # the handlers' own tokenizer: tokenizers aren't shareable across threads
    tokenizer = copy.deepcopy(engine.tokenizer)
    if chat_template is not None:
        if tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer; this model has none")
        tokenizer.chat_template = chat_template
    offload = Offload(tokenizer)  # tokenizing, grammars and big responses, off the event loop
    serving = OpenAIServing(engine, engine_loop, tokenizer, model_names[0], offload)
    app = FastAPI(
        title="pagedjax", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app_state.install(
        app,
        engine_loop=engine_loop,
        serving=serving,
        offload=offload,
        tokenizer=tokenizer,
        model_names=model_names,
        limits=limits,
        api_key=api_key,
        public_metrics=public_metrics,
        public_docs=public_docs,
        tool_config=tool_config or ToolConfig(),
        models=models,
    )
    if cors is not None:
        app.add_middleware(CORSMiddleware, **dataclasses.asdict(cors))
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for router in ROUTERS:
        app.include_router(router)
    _include_lora_updates(app, models)
    return app


def _include_lora_updates(app: FastAPI, models: ServedModels) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter, where run-time updates are on."""
    if not models.runtime_updates:
        return
    roots = models.updates.allowed_roots
    logger.warning(
        "LoRA adapters load and unload at run time (/v1/load_lora_adapter)%s",
        f" from under {list(roots)}" if roots else ", from any directory this server can read",
    )
    app.include_router(lora_router)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine thread runs while the app does; the offload threads close after it."""
    app.state.engine_loop.start()
    try:
        yield
    finally:
        await asyncio.to_thread(app.state.engine_loop.stop)
        app.state.offload.close()


async def _api_error(request, exc: APIError):
    return exc.response()


async def _http_error(request, exc: StarletteHTTPException):
    code = "not_found" if exc.status_code == 404 else None
    return error_response(exc.status_code, str(exc.detail), code=code)


async def _internal_error(request, exc: Exception):
    logger.exception("internal error")
    return error_response(500, f"internal error: {exc}", "server_error")
