"""The server's routes as module-level handlers; each reads its collaborators from
``request.app.state`` (app_state). ``ROUTERS`` lists them in the order build_app includes them.

- ``health_router``: /health and /ping (open to all), /metrics, /openapi.json, /docs, /redoc
- ``models_router``: /v1/models, /v1/models/{id}, /version
- ``tokenize_router``: /tokenize, /detokenize (vLLM's; serving_tokenization.py)
- ``generate_router``: /v1/completions (serving_completion.py), /v1/chat/completions
  (serving_chat.py; /v1/responses runs as one: routes_responses.py)
- ``lora_router`` (with --enable-lora and run-time updates only: pagedjax/lora/updates.py):
  /v1/load_lora_adapter, /v1/unload_lora_adapter
"""

from __future__ import annotations

import asyncio
import importlib.metadata

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagedjax.entrypoints.openai.app_state import check_key, read_constrained, read_json
from pagedjax.entrypoints.openai.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
    error_response,
    parse_body,
)
from pagedjax.metrics.server import CONTENT_TYPE

health_router = APIRouter()
models_router = APIRouter()
generate_router = APIRouter()
tokenize_router = APIRouter()
lora_router = APIRouter()
# and lora_router with LoRA on
ROUTERS = (health_router, models_router, tokenize_router, generate_router)


# -- health, metrics, docs --


@health_router.head("/health", include_in_schema=False)
@health_router.get("/health")
@health_router.get("/ping")  # vLLM's (SageMaker's health check)
@health_router.post("/ping", include_in_schema=False)
async def health(request: Request):
    if not request.app.state.engine_client.is_running:
        return error_response(503, "the engine thread is not running", "server_error")
    return PlainTextResponse("ok")


@health_router.get("/metrics")
async def metrics(request: Request):
    if not request.app.state.public_metrics:
        check_key(request)
    return Response(request.app.state.engine_client.metrics.render(), media_type=CONTENT_TYPE)


def _check_docs_key(request: Request) -> None:
    if not request.app.state.public_docs:
        check_key(request)


@health_router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    _check_docs_key(request)
    return JSONResponse(request.app.openapi())


@health_router.get("/docs", include_in_schema=False)
async def docs(request: Request):
    _check_docs_key(request)
    return get_swagger_ui_html(openapi_url="/openapi.json", title="pagedjax")


@health_router.get("/redoc", include_in_schema=False)
async def redoc(request: Request):
    _check_docs_key(request)
    return get_redoc_html(openapi_url="/openapi.json", title="pagedjax")


# -- models --


def _model_card(request: Request, name: str, lora=None) -> dict:
    """A model's card; a LoRA adapter's names its path as ``root`` and the base model as
    ``parent`` (vLLM's)."""
    state = request.app.state
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pagedjax",
        "root": name if lora is None else lora.lora_path,
        "parent": None if lora is None else state.models.parent,
        "max_model_len": state.engine_client.max_model_len,
    }


@models_router.get("/v1/models")
async def models(request: Request):
    check_key(request)
    served = request.app.state.models
    cards = [_model_card(request, name) for name in served.base_names]
    cards += [_model_card(request, lora.lora_name, lora) for lora in served.adapters()]
    return {"object": "list", "data": cards}


@models_router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    check_key(request)
    lora = request.app.state.models.resolve(model_id)
    return _model_card(request, model_id, lora)


@models_router.get("/version")
async def version(request: Request):
    check_key(request)
    return {"version": _VERSION}


def _package_version() -> str:
    try:
        return importlib.metadata.version("pagedjax")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


_VERSION = _package_version()


# -- tokens (vLLM's) --


@tokenize_router.post("/tokenize")
async def tokenize(request: Request):
    """A prompt's token ids, or a conversation's as /v1/chat/completions renders it (the same
    fields: ``messages``, ``tools``, ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template_kwargs``); ``return_token_strs`` adds each token's string."""
    check_key(request)
    state = request.app.state
    data = await read_json(request)
    chat = isinstance(data, dict) and "messages" in data
    req = parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
    if req.model is not None:
        state.models.resolve(req.model)
    return await state.serving_tokenization.create_tokenize(req)


@tokenize_router.post("/detokenize")
async def detokenize(request: Request):
    """The text of ``tokens``, each a token id of the vocabulary."""
    check_key(request)
    state = request.app.state
    req = parse_body(DetokenizeRequest, await read_json(request))
    if req.model is not None:
        state.models.resolve(req.model)
    return await state.serving_tokenization.create_detokenize(req)


# -- LoRA adapters at run time (vLLM's) --


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    """Load a PEFT adapter and serve it under ``lora_name``; 400 naming a taken name, a path
    the server may not read (one message for every reason), or what is wrong with the adapter.
    The engine reads and checks it on a thread of its own and installs it between steps:
    requests in flight go on meanwhile."""
    check_key(request)
    state = request.app.state
    body = parse_body(LoadLoRAAdapterRequest, await read_json(request))
    try:
        path = await asyncio.to_thread(state.models.updates.check_path, body.lora_path)
    except ValueError as e:
        raise bad_request(
            f"cannot load LoRA adapter {body.lora_name!r}: {e}", "lora_path"
        ) from None
    lora = state.models.reserve(body.lora_name, path)
    try:
        await asyncio.wrap_future(state.engine_client.command("add_lora", lora))
    except ValueError as e:
        state.models.release(lora)
        raise bad_request(
            f"cannot load LoRA adapter {lora.lora_name!r}: {e}", "lora_path"
        ) from None
    except BaseException:
        state.models.release(lora)
        raise
    state.models.register(lora)
    return PlainTextResponse(f"Success: LoRA adapter {lora.lora_name!r} added successfully.")


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    """Stop serving an adapter (404 naming an unknown one); its requests in flight finish
    under it."""
    check_key(request)
    state = request.app.state
    body = parse_body(UnloadLoRAAdapterRequest, await read_json(request))
    lora = state.models.unregister(body.lora_name)
    await asyncio.wrap_future(state.engine_client.command("remove_lora", lora.lora_int_id))
    return PlainTextResponse(f"Success: LoRA adapter {lora.lora_name!r} removed successfully.")


# -- generation (serving_completion, serving_chat) --


@generate_router.post("/v1/completions")
async def completions(request: Request):
    check_key(request)
    state = request.app.state
    req, constraint, constraint_field = await read_constrained(request, CompletionRequest)
    lora = state.models.resolve(req.model)  # a LoRA adapter's name runs under it
    serving = state.serving_completion
    return await serving.create_completion(request, req, constraint, constraint_field, lora)


@generate_router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    check_key(request)
    state = request.app.state
    req, constraint, constraint_field = await read_constrained(request, ChatRequest)
    lora = state.models.resolve(req.model)  # a LoRA adapter's name runs under it
    serving = state.serving_chat
    return await serving.create_chat_completion(request, req, constraint, constraint_field, lora)
