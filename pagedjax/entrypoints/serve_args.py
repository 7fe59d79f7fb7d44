"""``pagedjax serve``'s own flags (vLLM's frontend flags): the HTTP server, its start, its limits,
tool calling, the chat template, CORS and the adapters served from the start; and the
ServeOptions they make. The engine's flags are EngineArgs' (engine/arg_utils.py)."""

from __future__ import annotations

import argparse
import json

from pagedjax.entrypoints.request_log import DEFAULT_MAX_LOG_LEN

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(srv: argparse.ArgumentParser) -> None:
    _add_http_args(srv)
    _add_compile_args(srv)
    _add_limit_args(srv)
    g = srv.add_argument_group("chat and tools")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the model\'s calls are read by --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes (Qwen 2.5/3), llama3_json, pythonic",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a jinja chat template (a file, or the text) in place of the tokenizer's",
    )
    g.add_argument(
        "--reasoning-parser",
        type=_refused("reasoning_content is not split out of the content here"),
        default=None,
        help="refused: pagedjax returns a reasoning model's thinking in the content",
    )
    _add_cors_args(srv)
    _add_lora_args(srv)
    srv.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine in a process of its own (vLLM's engine core): this process only "
        "parses, tokenizes and answers HTTP, so that work never holds the engine's GIL",
    )


def _add_lora_args(srv: argparse.ArgumentParser) -> None:
    """The adapters a server serves (with --enable-lora, an engine flag): from the start, and
    loaded at run time (pagedjax/lora/updates.py)."""
    g = srv.add_argument_group("LoRA adapters served")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve from the start (with --enable-lora): a name and a PEFT "
        "adapter directory each",
    )
    g.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which also turns them on): any client that passes "
        "the API key may make the server read a directory; confine them with "
        "--lora-allowed-roots",
    )
    g.add_argument(
        "--lora-allowed-roots",
        nargs="+",
        default=None,
        metavar="DIR",
        help="directories that adapters loaded at run time must lie under",
    )


def _add_http_args(srv: argparse.ArgumentParser) -> None:
    g = srv.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /ping (an "
        "empty key is an error)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id clients use, and any aliases (default: --model as given)",
    )
    g.add_argument(
        "--public-metrics", action="store_true", help="serve /metrics without the API key"
    )
    g.add_argument(
        "--public-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json without the API key",
    )
    g.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves the API under (ASGI's root_path)",
    )
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate file")
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="the log level of uvicorn and of the server's own lines (default: info)",
    )
    g.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request received: its method, path and body (default: off)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older spelling: requests are not logged unless --enable-log-requests",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help=f"characters of a request body a logged line keeps (default: {DEFAULT_MAX_LOG_LEN})",
    )


def _add_cors_args(srv: argparse.ArgumentParser) -> None:
    """vLLM's cross-origin options; without --allowed-origins no browser origin is allowed."""
    g = srv.add_argument_group("CORS")
    g.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=None,
        metavar="JSON",
        help="browser origins that may call the server, e.g. '[\"http://localhost:3000\"]' or "
        "'[\"*\"]' (default: none; vLLM's default is all)",
    )
    g.add_argument(
        "--allowed-methods",
        type=_string_list,
        default=["*"],
        metavar="JSON",
        help="methods allowed origins may use (default: all)",
    )
    g.add_argument(
        "--allowed-headers",
        type=_string_list,
        default=["*"],
        metavar="JSON",
        help="headers allowed origins may send (default: all)",
    )
    g.add_argument(
        "--allow-credentials", action="store_true", help="let allowed origins send credentials"
    )


def _add_compile_args(srv: argparse.ArgumentParser) -> None:
    """When `serve` compiles its step programs: before answering, or in the background."""
    g = srv.add_argument_group("compiling before serving")
    g.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the common step programs (about a dozen model programs) before serving; "
        "--no-warmup: every program compiles on first use (default: on)",
    )
    g.add_argument(
        "--warmup-all",
        action="store_true",
        help="compile every step program before serving (minutes on a CPU)",
    )
    g.add_argument(
        "--background-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the server answers, compile the remaining programs on a background thread "
        "(else each compiles on first use; default: on)",
    )


def _add_limit_args(srv: argparse.ArgumentParser) -> None:
    """The server's limits on one request and on the queue (ServerLimits)."""
    g = srv.add_argument_group("request limits")
    g.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="waiting requests before 503, and the most prompts one request may carry "
        "(default 256)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="the largest request body, in bytes (default 1048576)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive before the request is dropped (408)",
    )
    g.add_argument(
        "--max-stop-strings",
        type=int,
        default=64,
        help="stop strings (and stop_token_ids) one request may carry (default 64)",
    )
    g.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=1024,
        help="characters in one stop string (default 1024)",
    )
    g.add_argument(
        "--max-response-logprobs",
        type=int,
        default=1 << 20,
        help="logprob entries one response may carry, counted up front from echo, logprobs, n "
        "and max_tokens; a request over it is a 400 (default 1048576)",
    )


def serve_options(args: argparse.Namespace):
    """The ServeOptions of parsed flags (ValueError for a bad one, before anything loads)."""
    from pagedjax.entrypoints.api_server import (
        Cors,
        ServeOptions,
        ServerLimits,
        check_api_key,
        load_chat_template,
    )
    from pagedjax.entrypoints.openai.tools import ToolConfig
    from pagedjax.lora.updates import LoRAUpdates

    check_api_key(args.api_key)
    for flag in ("lora_modules", "enable_lora_runtime_updates", "lora_allowed_roots"):
        if getattr(args, flag) and not args.enable_lora:
            raise ValueError(f"--{flag.replace('_', '-')} needs --enable-lora")
    cors = None
    if args.allowed_origins is not None:
        methods, headers = args.allowed_methods, args.allowed_headers
        cors = Cors(args.allowed_origins, methods, headers, args.allow_credentials)
    limits = ServerLimits(
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_response_logprobs=args.max_response_logprobs,
    )
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    return ServeOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        limits=limits,
        public_metrics=args.public_metrics,
        public_docs=args.public_docs,
        tool_config=ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser),
        uvicorn_log_level=args.uvicorn_log_level,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        warmup=args.warmup,
        warmup_all=args.warmup_all,
        background_compile=args.background_compile,
        lora_modules=args.lora_modules,
        lora_updates=LoRAUpdates.from_options(
            args.enable_lora_runtime_updates, args.lora_allowed_roots
        ),
        engine_process=args.engine_process,
        chat_template=load_chat_template(args.chat_template),
        cors=cors,
    )


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules: name=path."""
    from pagedjax.entrypoints.openai.serving_models import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _string_list(text: str) -> list[str]:
    """A JSON list of strings (an argparse type)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def _refused(why: str):
    """An argparse type for a flag pagedjax lacks: any value is a usage error saying why."""

    def refuse(text: str):
        raise argparse.ArgumentTypeError(f"not supported ({why}), got {text!r}")

    return refuse
