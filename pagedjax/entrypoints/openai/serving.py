"""The FastAPI app: /v1/completions, /v1/chat/completions (both streaming as server-sent events),
/v1/models, vLLM's /tokenize, /detokenize and /version, /health (and /ping), Prometheus /metrics
and the API docs.

A request is validated whole (protocol), every prompt passes the engine's admission check, and
only then is anything submitted to the engine. build_app puts the shared objects on
``app.state`` (app_state) and includes the routers (routes), whose module-level handlers read
them from there. Each endpoint has its serving object (serving_completion, serving_chat,
serving_tokenization, over serving_engine's shared base); metrics in metrics. Handlers reach
the engine only through its EngineClient (engine/client.py).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedjax.engine.client import EngineClient
from pagedjax.entrypoints.openai import app_state
from pagedjax.entrypoints.openai.app_options import (
    AppOptions,
    Cors,
    check_api_key,
    load_chat_template,
)
from pagedjax.entrypoints.openai.offload import Offload
from pagedjax.entrypoints.openai.protocol import APIError, error_response
from pagedjax.entrypoints.openai.routes import ROUTERS, lora_router
from pagedjax.entrypoints.openai.routes_responses import responses_router
from pagedjax.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedjax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedjax.entrypoints.openai.serving_models import ServedModels
from pagedjax.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedjax.entrypoints.openai.tools import ToolConfig
from pagedjax.lora.updates import LoRAUpdates

__all__ = ["AppOptions", "Cors", "build_app", "check_api_key", "load_chat_template"]

logger = logging.getLogger("pagedjax.api_server")


def build_app(
    client: EngineClient, served_model_name: str | list[str], options: AppOptions | None = None
) -> FastAPI:
    """The FastAPI app over ``client`` (an EngineClient, engine/client.py: the engine on a
    thread of this process or in a process of its own); the engine steps while the app runs.

    ``served_model_name`` is the model id, or several aliases: requests may name any of them,
    /v1/models lists them all, responses carry the first. ``options``: what the app serves and
    how (app_options.py: the API key, limits, tools, LoRA adapters, chat template, CORS).
    """
    o = options or AppOptions()
    model_names = (
        [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    )
    if not model_names or not all(isinstance(n, str) and n for n in model_names):
        raise ValueError(f"served model names must be non-empty strings, got {model_names!r}")
    updates = o.lora_updates or LoRAUpdates.from_options()  # default: vLLM's environment variable
    models = ServedModels.for_engine(client, model_names, o.lora_modules, updates)
    client.metrics.model_name = model_names[0]  # the vllm: series' model_name label
    # the handlers' own tokenizer: tokenizers aren't shareable across threads
    tokenizer = copy.deepcopy(client.tokenizer)
    if o.chat_template is not None:
        if tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer; this model has none")
        tokenizer.chat_template = o.chat_template
    offload = Offload(tokenizer)  # tokenizing, grammars and big responses, off the event loop
    args = (client, tokenizer, model_names[0], offload, o.limits)
    endpoints = app_state.Endpoints(
        completion=OpenAIServingCompletion(*args),
        chat=OpenAIServingChat(*args, tool_config=o.tool_config or ToolConfig()),
        tokenization=OpenAIServingTokenization(*args),
    )
    app = FastAPI(
        title="pagedjax", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app_state.install(
        app,
        engine_client=client,
        endpoints=endpoints,
        offload=offload,
        tokenizer=tokenizer,
        model_names=model_names,
        options=o,
        models=models,
    )
    if o.cors is not None:
        app.add_middleware(CORSMiddleware, **dataclasses.asdict(o.cors))
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(responses_router)
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
    """The engine steps while the app runs; the offload threads close after it."""
    app.state.engine_client.start()
    try:
        yield
    finally:
        await asyncio.to_thread(app.state.engine_client.stop)
        app.state.offload.close()


async def _api_error(request, exc: APIError):
    return exc.response()


async def _http_error(request, exc: StarletteHTTPException):
    code = "not_found" if exc.status_code == 404 else None
    return error_response(exc.status_code, str(exc.detail), code=code)


async def _internal_error(request, exc: Exception):
    logger.exception("internal error")
    return error_response(500, f"internal error: {exc}", "server_error")
