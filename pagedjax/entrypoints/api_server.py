"""``pagedjax serve``: load the model and run the OpenAI-compatible server (the app itself is in
``pagedjax.entrypoints.openai``). The server answers once the common programs are compiled; the
rest compile in the background (pagedjax/entrypoints/startup.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from pagedjax.entrypoints import startup
from pagedjax.entrypoints.log_setup import log_to_stderr
from pagedjax.entrypoints.openai.engine_client import EngineProcess, RemoteEngine
from pagedjax.entrypoints.openai.engine_loop import EngineLoop, QueueFull
from pagedjax.entrypoints.openai.engine_process import EngineOptions
from pagedjax.entrypoints.openai.protocol import ServerLimits
from pagedjax.entrypoints.openai.serving import (
    Cors,
    build_app,
    check_api_key,
    load_chat_template,
)

__all__ = [
    "Cors",
    "EngineLoop",
    "QueueFull",
    "ServerLimits",
    "build_app",
    "check_api_key",
    "load_chat_template",
    "serve",
]

logger = logging.getLogger("pagedjax.api_server")


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    limits: ServerLimits | None = None,
    public_metrics: bool = False,
    public_docs: bool = False,
    tool_config=None,
    log_level: str = "info",
    warmup: bool = True,
    warmup_all: bool = False,
    background_compile: bool = True,
    lora_modules: list[tuple[str, str]] | None = None,
    lora_updates=None,
    engine_process: bool = False,
    chat_template: str | None = None,
    cors: Cors | None = None,
    **llm_kwargs,
) -> None:
    """Load the model and serve it until interrupted. Bad options raise ValueError before the
    model loads. Before it answers the server compiles the common programs (``warmup``), or
    every program (``warmup_all``), or nothing; with ``background_compile`` the rest compile on
    a background thread once it answers, else each on first use. ``lora_modules``: (name, path)
    LoRA adapters served from the start (needs ``enable_lora=True``); ``lora_updates``: those
    loaded at run time, and from where (pagedjax/lora/updates.py). With ``engine_process`` the
    engine runs in a process of its own (openai/engine_process.py): this one only serves
    HTTP, so its parsing, tokenizing and response building never hold the engine's GIL.
    ``chat_template`` (jinja) replaces the tokenizer's; ``cors`` opens the server to browser
    origins."""
    import uvicorn

    from pagedjax import LLM
    from pagedjax.models.loader import default_model_path

    check_api_key(api_key)
    if lora_modules and not llm_kwargs.get("enable_lora"):
        raise ValueError("lora_modules (--lora-modules) needs enable_lora (--enable-lora)")
    limits = limits or ServerLimits()
    # The id clients use: the aliases given, else the name the user passed (not a resolved
    # cache path), else the embedded model's file name.
    names = served_model_name or model or Path(default_model_path()).stem
    model = model or default_model_path()
    log_to_stderr(log_level)
    app_kwargs = dict(api_key=api_key, limits=limits, public_metrics=public_metrics, cors=cors)
    app_kwargs |= dict(
        public_docs=public_docs, tool_config=tool_config, chat_template=chat_template
    )
    app_kwargs |= dict(lora_modules=lora_modules, lora_updates=lora_updates)
    if engine_process:
        compiles = dict(warmup=warmup, warmup_all=warmup_all, background_compile=background_compile)
        options = EngineOptions(
            model, llm_kwargs, limits.max_queue, **compiles, log_level=log_level
        )
        _serve_engine_process(options, names, app_kwargs, host, port)
        return
    llm = LLM(model, **llm_kwargs)
    start = startup.prepare(
        llm, warmup=warmup, warmup_all=warmup_all, background=background_compile
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
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        if app is not None and app.state.engine_loop.is_running:  # a step outlived shutdown
            logger.warning("the engine thread is still stepping; leaving the engine open")
        else:
            llm.close()  # in a multi-process run this stops the followers


def _serve_engine_process(
    options: EngineOptions, names, app_kwargs: dict, host: str, port: int
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
        uvicorn.run(app, host=host, port=port, log_level=options.log_level)
    finally:
        if process.process.is_alive():
            process.stop()
