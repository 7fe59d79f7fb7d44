"""``pagedjax serve``: load the model and run the OpenAI-compatible server (the app itself is in
``pagedjax.entrypoints.openai``). The server answers once the common programs are compiled; the
rest compile in the background (pagedjax/entrypoints/startup.py)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from pagedjax.engine.arg_utils import EngineArgs
from pagedjax.engine.hosting import startup
from pagedjax.engine.hosting.engine_client import EngineProcess, RemoteEngine
from pagedjax.engine.hosting.engine_loop import EngineLoop, QueueFull
from pagedjax.engine.hosting.engine_process import EngineOptions
from pagedjax.engine.stats_log import start_stats_log
from pagedjax.entrypoints.log_setup import log_to_stderr
from pagedjax.entrypoints.openai.protocol import ServerLimits
from pagedjax.entrypoints.openai.serving import (
    Cors,
    build_app,
    check_api_key,
    load_chat_template,
)
from pagedjax.entrypoints.request_log import RequestLog

__all__ = [
    "Cors",
    "EngineLoop",
    "QueueFull",
    "ServeOptions",
    "ServerLimits",
    "build_app",
    "check_api_key",
    "load_chat_template",
    "serve",
]

logger = logging.getLogger("pagedjax.api_server")


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What ``pagedjax serve`` adds to the engine's options (EngineArgs): the HTTP server
    (address, TLS, key, limits, uvicorn's log level, the root path behind a proxy, request
    logging), its start (which programs compile before it answers), the adapters served from
    the start, the engine process, the chat template and CORS. ``pagedjax serve --help`` has
    each one's flag and help."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | list[str] | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    public_metrics: bool = False
    public_docs: bool = False
    tool_config: object = None  # openai.tools.ToolConfig
    uvicorn_log_level: str = "info"
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    enable_log_requests: bool = False
    max_log_len: int | None = None
    warmup: bool = True
    warmup_all: bool = False
    background_compile: bool = True
    lora_modules: list[tuple[str, str]] | None = None
    lora_updates: object = None  # lora.updates.LoRAUpdates: adapters loaded at run time, from where
    engine_process: bool = False
    chat_template: str | None = None
    cors: Cors | None = None

    def uvicorn_kwargs(self) -> dict:
        return dict(
            host=self.host,
            port=self.port,
            log_level=self.uvicorn_log_level,
            root_path=self.root_path,
            ssl_keyfile=self.ssl_keyfile,
            ssl_certfile=self.ssl_certfile,
        )


def serve(engine_args: EngineArgs | None = None, options: ServeOptions | None = None) -> None:
    """Load the model and serve it until interrupted. Bad options raise ValueError before the
    model loads. Before it answers the server compiles the common programs (``warmup``), or
    every program (``warmup_all``), or nothing; with ``background_compile`` the rest compile on
    a background thread once it answers, else each on first use. ``lora_modules``: (name, path)
    LoRA adapters served from the start (needs ``enable_lora``); ``lora_updates``: those loaded
    at run time, and from where (pagedjax/lora/updates.py). With ``engine_process`` the engine
    runs in a process of its own (openai/engine_process.py): this one only serves HTTP, so its
    parsing, tokenizing and response building never hold the engine's GIL."""
    import uvicorn

    from pagedjax import LLM
    from pagedjax.models.loader import default_model_path

    engine_args = engine_args or EngineArgs()
    o = options or ServeOptions()
    check_api_key(o.api_key)
    if o.lora_modules and not engine_args.enable_lora:
        raise ValueError("lora_modules (--lora-modules) needs enable_lora (--enable-lora)")
    # The id clients use: the aliases given, else the name the user passed (not a resolved
    # cache path), else the embedded model's file name.
    names = o.served_model_name or engine_args.model or Path(default_model_path()).stem
    log_to_stderr(o.uvicorn_log_level)
    app_kwargs = dict(
        api_key=o.api_key,
        limits=o.limits,
        public_metrics=o.public_metrics,
        public_docs=o.public_docs,
        tool_config=o.tool_config,
        lora_modules=o.lora_modules,
        lora_updates=o.lora_updates,
        chat_template=o.chat_template,
        cors=o.cors,
    )
    if o.engine_process:
        compiles = dict(
            warmup=o.warmup, warmup_all=o.warmup_all, background_compile=o.background_compile
        )
        engine = EngineOptions(
            engine_args, o.limits.max_queue, **compiles, log_level=o.uvicorn_log_level
        )
        _serve_engine_process(engine, names, app_kwargs, o)
        return
    llm = LLM(**engine_args.keywords())
    start = startup.prepare(
        llm, warmup=o.warmup, warmup_all=o.warmup_all, background=o.background_compile
    )
    if not llm.engine.is_driver:  # multi-process: process 0 serves; this one replays its steps
        llm.engine.follow()
        llm.close()
        return
    app = None
    try:
        app = build_app(llm.engine, names, **app_kwargs)
        app.state.engine_loop.attach_startup(start)
        app.state.offload.checker.start()  # its workers ready before big bodies come
        if not engine_args.disable_log_stats:
            start_stats_log(lambda: app.state.engine_loop.metrics.engine_stats)
        uvicorn.run(_logged(app, o), **o.uvicorn_kwargs())
    finally:
        if app is not None and app.state.engine_loop.is_running:  # a step outlived shutdown
            logger.warning("the engine thread is still stepping; leaving the engine open")
        else:
            llm.close()  # in a multi-process run this stops the followers


def _logged(app, o: ServeOptions):
    """The app, wrapped to log each request when ``enable_log_requests``."""
    return RequestLog(app, o.max_log_len) if o.enable_log_requests else app


def _serve_engine_process(
    options: EngineOptions, names, app_kwargs: dict, serve_options: ServeOptions
) -> None:
    """Serve with the engine in a process of its own, until interrupted; the engine process
    stops with the server."""
    import uvicorn

    process = EngineProcess(options)
    try:
        info = process.wait_ready()
        if info is None:  # a follower of a multi-process run: its engine replays the driver's
            process.process.join()
            return
        app = build_app(RemoteEngine(info, process), names, **app_kwargs)
        app.state.offload.checker.start()  # its workers ready before big bodies come
        uvicorn.run(_logged(app, serve_options), **serve_options.uvicorn_kwargs())
    finally:
        if process.process.is_alive():
            process.stop()
