"""The FastAPI app: /v1/completions, /v1/chat/completions (both streaming as server-sent events),
/v1/models, /health, Prometheus /metrics and the API docs.

A request is validated whole (protocol), every prompt passes the engine's admission check, and
only then is anything submitted to the engine thread (engine_loop). Generation and streaming are
in serving_engine; metrics in metrics. Handlers reach the engine only through the engine loop.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedjax.entrypoints.openai.engine_loop import EngineLoop
from pagedjax.entrypoints.openai.metrics import CONTENT_TYPE
from pagedjax.entrypoints.openai.offload import HEAVY_BODY_BYTES, Offload
from pagedjax.entrypoints.openai.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ServerLimits,
    bad_request,
    chat_messages,
    check_response_logprobs,
    error_response,
    logit_bias,
    parse_json,
    parse_request,
    sampling_params,
    structured_outputs,
)
from pagedjax.entrypoints.openai.serving_engine import Echo, OpenAIServing
from pagedjax.entrypoints.openai.tools import ToolConfig, template_messages, tool_mode

logger = logging.getLogger("pagedjax.api_server")


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
) -> FastAPI:
    """The FastAPI app over ``engine``; the engine thread starts and stops with the app.

    ``served_model_name`` is the model id, or several aliases: requests may name any of them,
    /v1/models lists them all, responses carry the first. With ``api_key`` every route but
    /health needs it, /metrics and the API docs too unless ``public_metrics`` / ``public_docs``
    open them. ``tool_config``: whether tool_choice "auto" is served, with which parser.
    """
    check_api_key(api_key)
    tool_config = tool_config or ToolConfig()
    model_names = (
        [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    )
    if not model_names or not all(isinstance(n, str) and n for n in model_names):
        raise ValueError(f"served model names must be non-empty strings, got {model_names!r}")
    limits = limits or ServerLimits()
    loop_owner = EngineLoop(engine, max_queue=limits.max_queue)
    # the handlers' own tokenizer: tokenizers aren't shareable across threads
    tokenizer = copy.deepcopy(engine.tokenizer)
    offload = Offload(tokenizer)  # tokenizing, grammars and big responses, off the event loop
    serving = OpenAIServing(engine, loop_owner, tokenizer, model_names[0], offload)
    max_model_len = serving.max_model_len
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        loop_owner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop_owner.stop)
            offload.close()

    app = FastAPI(
        title="pagedjax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.engine_loop = loop_owner
    app.state.limits = limits

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {exc}", "server_error")

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(
                401, "invalid or missing API key", "invalid_request_error", "invalid_api_key"
            )

    async def read_json(request: Request):
        """The body, parsed strictly; it must arrive within ``limits.body_timeout_s``."""
        too_big = APIError(
            413, f"request body over {limits.max_body_bytes} bytes", "invalid_request_error"
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            raise too_big
        body = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_s
        chunks = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(anext(chunks), deadline - loop.time())
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {limits.body_timeout_s} s",
                    "invalid_request_error",
                    "request_timeout",
                ) from None
            except ClientDisconnect:
                raise bad_request("the client left before sending the whole body") from None
            body += chunk
            if len(body) > limits.max_body_bytes:
                raise too_big
        if len(body) > HEAVY_BODY_BYTES:
            offload.mark_heavy()  # its parsing and tokenizing never queue small requests' work
        return await offload.run(parse_json, bytes(body))

    def parse(model_cls, data):
        req = parse_request(model_cls, data)
        if req.model not in model_names:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {model_names}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return req

    # -- routes --

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health():
        if not loop_owner.is_running:
            return error_response(503, "the engine thread is not running", "server_error")
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics(request: Request):
        if not public_metrics:
            check_key(request)
        return Response(loop_owner.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        if not public_docs:
            check_key(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        if not public_docs:
            check_key(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pagedjax")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        if not public_docs:
            check_key(request)
        return get_redoc_html(openapi_url="/openapi.json", title="pagedjax")

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagedjax",
            "max_model_len": max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card(name) for name in model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        check_key(request)
        if model_id not in model_names:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist; this server serves {model_names}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        req = await offload.run(parse, CompletionRequest, await read_json(request))
        p = req.prompt
        if isinstance(p, str):
            texts, prompts = [p], None
        elif p and all(isinstance(x, str) for x in p):
            texts, prompts = p, None
        elif p and all(isinstance(x, list) for x in p):
            texts, prompts = None, [list(x) for x in p]
        else:
            texts, prompts = None, [list(p)]
        count = len(texts or prompts)
        if count > limits.max_queue:
            raise bad_request(
                f"prompt: {count} prompts in one request; this server queues at most "
                f"{limits.max_queue}",
                "prompt",
            )
        prompts = await serving.prompt_ids(texts, prompts)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = max(max_model_len - max(len(x) for x in prompts), 1)
        echo_only = req.echo and max_tokens == 0  # the engine makes one token, never shown
        constraint, constraint_field = structured_outputs(req)
        await serving.check_constraint(constraint, constraint_field)
        extra = {"logit_bias": logit_bias(req, serving.vocab), "structured_outputs": constraint}
        if req.echo and req.logprobs is not None:
            extra["prompt_logprobs"] = req.logprobs
        params = sampling_params(
            req, 1 if echo_only else max_tokens, "max_tokens", req.logprobs, limits, **extra
        )
        shown = 0 if echo_only else max_tokens
        check_response_logprobs(
            limits,
            prompts,
            k=req.logprobs,
            n=req.n,
            max_tokens=shown,
            echo=req.echo,
            field="logprobs",
        )
        await serving.admit(prompts, params, "prompt")
        echo = None
        if req.echo:
            echo = Echo(texts or await serving.echo_texts(prompts), echo_only)
        return await serving.run(
            request, req, prompts, params, chat=False, k_logprobs=req.logprobs, echo=echo
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        req = await offload.run(parse, ChatRequest, await read_json(request))
        if tokenizer is None or tokenizer.chat_template is None:
            raise bad_request("this model's tokenizer has no chat template")
        constraint, constraint_field = structured_outputs(req)
        shown_tools, tools = tool_mode(req, tool_config, constraint)
        if tools is not None and tools.constraint is not None:  # "required" or named
            constraint, constraint_field = tools.constraint, "tools"
        messages = template_messages(chat_messages(req))
        ids = await serving.chat_prompt_ids(messages, shown_tools)
        if req.max_completion_tokens is not None:
            max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = req.max_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = max(max_model_len - len(ids), 1)
        k = None
        if req.logprobs:
            k = req.top_logprobs or 0
        elif req.top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        await serving.check_constraint(constraint, constraint_field)
        extra = {"logit_bias": logit_bias(req, serving.vocab), "structured_outputs": constraint}
        params = sampling_params(req, max_tokens, field, k, limits, **extra)
        lp_field = "top_logprobs" if req.top_logprobs else "logprobs"
        check_response_logprobs(
            limits, [ids], k=k, n=req.n, max_tokens=max_tokens, echo=False, field=lp_field
        )
        await serving.admit([ids], params, "messages")
        return await serving.run(request, req, [ids], params, chat=True, k_logprobs=k, tools=tools)

    return app
