"""What the route handlers share, kept on ``app.state``: the engine client, each endpoint's
serving object (``serving_completion``, ``serving_chat``, ``serving_tokenization``), the limits,
the served names and LoRA adapters (serving_models), the API key and the options that open
routes. ``install`` puts them there once (build_app); the helpers here read them from
``request.app.state``.
"""

from __future__ import annotations

import dataclasses
import hmac
import time

from fastapi import FastAPI, Request

from pagedjax.engine.client import EngineClient
from pagedjax.entrypoints.openai import guided
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.offload import INLINE_BODY_BYTES, Offload
from pagedjax.entrypoints.openai.protocol import APIError, parse_json, parse_request
from pagedjax.entrypoints.openai.request_body import read_body_within
from pagedjax.entrypoints.openai.request_params import structured_outputs
from pagedjax.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedjax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedjax.entrypoints.openai.serving_models import ServedModels, model_not_found
from pagedjax.entrypoints.openai.serving_tokenization import OpenAIServingTokenization


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """The serving object of each endpoint (vLLM's openai_serving_*)."""

    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization


def install(
    app: FastAPI,
    *,
    engine_client: EngineClient,
    endpoints: Endpoints,
    offload: Offload,
    tokenizer,
    model_names: list[str],
    options: AppOptions,
    models: ServedModels | None = None,
) -> None:
    """Everything a handler needs, on ``app.state`` (one app, one set)."""
    state = app.state
    state.engine_client = engine_client
    state.serving_completion = endpoints.completion
    state.serving_chat = endpoints.chat
    state.serving_tokenization = endpoints.tokenization
    state.offload = offload
    state.tokenizer = tokenizer  # the handlers' own: tokenizers aren't shareable across threads
    state.model_names = model_names  # the base model's names
    state.models = models or ServedModels(model_names)  # and the LoRA adapters'
    state.limits = options.limits
    state.api_key = options.api_key
    state.public_metrics = options.public_metrics
    state.public_docs = options.public_docs
    state.created = int(time.time())


def check_key(request: Request) -> None:
    """401 unless the request carries the server's API key (any request when there is none)."""
    api_key = request.app.state.api_key
    if api_key is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise APIError(
            401, "invalid or missing API key", "invalid_request_error", "invalid_api_key"
        )


__all__ = [
    "Endpoints",
    "check_key",
    "install",
    "model_not_found",
    "read_constrained",
    "read_json",
]


def parse_for_model(models: ServedModels, model_cls, data):
    """``data`` validated as ``model_cls``, naming one of the served models or LoRA adapters
    (runs off the loop)."""
    req = parse_request(model_cls, data)
    models.resolve(req.model)
    return req


async def read_constrained(request: Request, model_cls):
    """(request, its structured-output constraint or None, the field it came from): the body
    parsed strictly as ``model_cls`` and its constraint checked against its limits; a body of
    more than INLINE_BODY_BYTES in the body-check process (body_check.py), so that no walk
    over it holds the event loop's GIL."""
    state = request.app.state
    body = await read_body(request)
    if len(body) > INLINE_BODY_BYTES:
        resolve = lambda req: state.models.resolve(req.model)  # noqa: E731
        return await state.offload.checker.check(model_cls, body, resolve)
    data = await state.offload.run(parse_json, body)
    req = await state.offload.run(parse_for_model, state.models, model_cls, data)
    rf = req.response_format
    constrained = rf is not None and rf.get("type") != "text" or guided.given(req)
    if req.structured_outputs is not None or constrained:
        return req, *await state.offload.run_grammar(structured_outputs, req)
    return req, *structured_outputs(req)


async def read_json(request: Request):
    """The body, parsed strictly; it must arrive within ``limits.body_timeout_s``."""
    body = await read_body(request)
    return await request.app.state.offload.run(parse_json, body)


async def read_body(request: Request) -> bytes:
    """The body's bytes, within the server's limits (request_body.py). Sets the request's
    offload lane by its size (``Offload.mark_body``)."""
    body = await read_body_within(request, request.app.state.limits)
    request.app.state.offload.mark_body(len(body))  # heavy: its work never queues small ones'
    return body
