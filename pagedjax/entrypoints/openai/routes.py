"""The server's routes as module-level handlers; each reads its collaborators from
``request.app.state`` (app_state). ``ROUTERS`` lists them in the order build_app includes them.

- ``health_router``: /health and /ping (open to all), /metrics, /openapi.json, /docs, /redoc
- ``models_router``: /v1/models, /v1/models/{id}, /version
- ``tokenize_router``: /tokenize, /detokenize (vLLM's)
- ``generate_router``: /v1/completions, /v1/chat/completions (and /v1/responses, which runs as
  a chat completion: routes_responses.py)
- ``lora_router`` (with --enable-lora and run-time updates only: pagedjax/lora/updates.py):
  /v1/load_lora_adapter, /v1/unload_lora_adapter
"""

from __future__ import annotations

import asyncio
import importlib.metadata

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagedjax.core.request_queue import check_priority
from pagedjax.entrypoints.openai.app_state import check_key, read_constrained, read_json
from pagedjax.entrypoints.openai.metrics import CONTENT_TYPE
from pagedjax.entrypoints.openai.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
    chat_messages,
    chat_options,
    error_response,
    parse_body,
)
from pagedjax.entrypoints.openai.request_params import (
    beam_search_params,
    check_response_logprobs,
    default_max_tokens,
    logit_bias,
    sampling_params,
)
from pagedjax.entrypoints.openai.serving_engine import Echo
from pagedjax.entrypoints.openai.tools import template_messages, tool_mode

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
        "max_model_len": state.serving.max_model_len,
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
    return await state.serving.tokenize_body(req)


@tokenize_router.post("/detokenize")
async def detokenize(request: Request):
    """The text of ``tokens``, each a token id of the vocabulary."""
    check_key(request)
    state = request.app.state
    req = parse_body(DetokenizeRequest, await read_json(request))
    if req.model is not None:
        state.models.resolve(req.model)
    return await state.serving.detokenize_body(req)


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


# -- generation --


def _split_prompt(p) -> tuple[list[str] | None, list[list[int]] | None]:
    """A completion request's ``prompt`` as (texts, None) or (None, token id lists)."""
    if isinstance(p, str):
        return [p], None
    if p and all(isinstance(x, str) for x in p):
        return p, None
    if p and all(isinstance(x, list) for x in p):
        return None, [list(x) for x in p]
    return None, [list(p)]


@generate_router.post("/v1/completions")
async def completions(request: Request):
    check_key(request)
    state = request.app.state
    serving, limits = state.serving, state.limits
    req, constraint, constraint_field = await read_constrained(request, CompletionRequest)
    lora = state.models.resolve(req.model)  # a LoRA adapter's name runs under it
    texts, prompts = _split_prompt(req.prompt)
    count = len(texts or prompts)
    if count > limits.max_queue:
        raise bad_request(
            f"prompt: {count} prompts in one request; this server queues at most "
            f"{limits.max_queue}",
            "prompt",
        )
    prompts = await serving.prompt_ids(texts, prompts, req.truncate_prompt_tokens)
    max_tokens = req.max_tokens
    if max_tokens is None:
        room = serving.max_model_len - max(len(x) for x in prompts)
        max_tokens = default_max_tokens(room, serving.defaults)
    echo_only = req.echo and max_tokens == 0  # the engine makes one token, never shown
    await serving.check_constraint(constraint, constraint_field)
    extra = {"logit_bias": logit_bias(req, serving.vocab), "structured_outputs": constraint}
    asked = [req.prompt_logprobs, req.logprobs if req.echo else None]  # vLLM's field, echo's
    asked = [k for k in asked if k is not None]
    if asked:
        extra["prompt_logprobs"] = max(asked)
    max_tokens_run = 1 if echo_only else max_tokens
    if req.use_beam_search:
        refused = constraint_field if constraint is not None else None
        params = beam_search_params(req, max_tokens_run, "max_tokens", refused)
    else:
        params = sampling_params(
            req,
            max_tokens_run,
            "max_tokens",
            req.logprobs,
            limits,
            defaults=serving.defaults,
            **extra,
        )
    shown = 0 if echo_only else max_tokens
    check_response_logprobs(
        limits, prompts, k=req.logprobs, n=req.n, max_tokens=shown, echo=req.echo, field="logprobs"
    )
    _check_prompt_logprobs(limits, prompts * req.n, req.prompt_logprobs)  # on every choice
    _check_priority(serving, req.priority)
    await serving.admit(prompts, params, "prompt")
    echo = None
    if req.echo:
        if texts is None or req.truncate_prompt_tokens is not None:  # the prompt that runs
            texts = await serving.echo_texts(prompts)
        echo = Echo(texts, echo_only)
    return await serving.run(
        request, req, prompts, params, chat=False, k_logprobs=req.logprobs, echo=echo, lora=lora
    )


def _check_priority(serving, priority: int) -> None:
    """vLLM's ``priority``: any integer under --scheduling-policy priority, else only 0."""
    try:
        check_priority(priority, serving.client.config.scheduler.policy)
    except ValueError as e:
        raise bad_request(str(e), "priority") from None


def _check_prompt_logprobs(limits, prompts, k: int | None) -> None:
    """vLLM's prompt_logprobs: k alternatives and its own per token of each of ``prompts``."""
    check_response_logprobs(
        limits, prompts, k=k, n=1, max_tokens=0, echo=True, field="prompt_logprobs"
    )


def _chat_tools(req, tool_config, constraint, field):
    """(constraint, its field, the tools shown to the template, the tool mode) of a chat request
    whose own structured output is ``constraint`` (from ``field``): it, or the schema its tool
    choice imposes. Walks the tools' schemas: off the event loop when there are tools."""
    shown_tools, tools = tool_mode(req, tool_config, constraint)
    if tools is not None and tools.constraint is not None:  # "required" or named
        constraint, field = tools.constraint, "tools"
    return constraint, field, shown_tools, tools


@generate_router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    check_key(request)
    req, constraint, constraint_field = await read_constrained(request, ChatRequest)
    return await run_chat(request, req, constraint, constraint_field)


async def run_chat(request: Request, req: ChatRequest, constraint, constraint_field: str):
    """Answer a parsed chat request whose own constraint (response_format, structured_outputs
    or a guided field) is ``constraint``, from ``constraint_field``: /v1/chat/completions, and
    /v1/responses, which runs as one (routes_responses.py)."""
    state = request.app.state
    serving, limits, tokenizer = state.serving, state.limits, state.tokenizer
    lora = state.models.resolve(req.model)  # a LoRA adapter's name runs under it
    if tokenizer is None or tokenizer.chat_template is None:
        raise bad_request("this model's tokenizer has no chat template")
    args = (req, state.tool_config, constraint, constraint_field)
    if req.tools:
        constraint, constraint_field, shown_tools, tools = await serving.offload.run_grammar(
            _chat_tools, *args
        )
    else:
        constraint, constraint_field, shown_tools, tools = _chat_tools(*args)
    options = chat_options(req)
    messages = template_messages(chat_messages(req))
    ids = await serving.chat_prompt_ids(messages, shown_tools, options, req.truncate_prompt_tokens)
    if req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = req.max_tokens, "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens(serving.max_model_len - len(ids), serving.defaults)
    k = None
    if req.logprobs:
        k = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    await serving.check_constraint(constraint, constraint_field)
    extra = {"logit_bias": logit_bias(req, serving.vocab), "structured_outputs": constraint}
    if req.prompt_logprobs is not None:
        extra["prompt_logprobs"] = req.prompt_logprobs
    if req.use_beam_search:
        refused = constraint_field if constraint is not None else None
        params = beam_search_params(req, max_tokens, field, refused)
    else:
        params = sampling_params(
            req, max_tokens, field, k, limits, defaults=serving.defaults, **extra
        )
    lp_field = "top_logprobs" if req.top_logprobs else "logprobs"
    check_response_logprobs(
        limits, [ids], k=k, n=req.n, max_tokens=max_tokens, echo=False, field=lp_field
    )
    _check_prompt_logprobs(limits, [ids], req.prompt_logprobs)
    _check_priority(serving, req.priority)
    await serving.admit([ids], params, "messages")
    return await serving.run(
        request, req, [ids], params, chat=True, k_logprobs=k, tools=tools, lora=lora
    )
