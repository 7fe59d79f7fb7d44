"""``pagedjax serve``: load the model and run the OpenAI-compatible server (the app itself is in
``pagedjax.entrypoints.openai``). The server answers once the common programs are compiled; the
rest compile in the background (engine/hosting/startup.py). The engine and the app start through
``entrypoints/launch.py``."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from pagedjax.engine.arg_utils import EngineArgs
from pagedjax.engine.client import QueueFull
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.engine.hosting.startup import EngineOptions
from pagedjax.entrypoints.launch import launch_server
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.protocol import ServerLimits
from pagedjax.entrypoints.openai.serving import (
    Cors,
    build_app,
    check_api_key,
    load_chat_template,
)
from pagedjax.entrypoints.request_log import RequestLog
from pagedjax.utils.log_setup import log_to_stderr

__all__ = [
    "AppOptions",
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
class ServeOptions(AppOptions):
    """What ``pagedjax serve`` adds to the engine's options (EngineArgs): the app's (AppOptions:
    the key, limits, tools, the adapters served, the chat template and CORS), the HTTP server
    (address, uvicorn's log level, the root path behind a proxy, TLS, request logging), its
    start (which programs compile before it answers) and the engine process. ``pagedjax serve
    --help`` has each one's flag and help."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | list[str] | None = None
    uvicorn_log_level: str = "info"
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    enable_log_requests: bool = False
    max_log_len: int | None = None
    warmup: bool = True
    warmup_all: bool = False
    background_compile: bool = True
    engine_process: bool = False

    def uvicorn_kwargs(self) -> dict:
        return dict(
            host=self.host,
            port=self.port,
            log_level=self.uvicorn_log_level,
            root_path=self.root_path,
            ssl_keyfile=self.ssl_keyfile,
            ssl_certfile=self.ssl_certfile,
        )

    def engine_options(self, engine_args: EngineArgs) -> EngineOptions:
        """How the engine starts: its arguments, the queue limit, what compiles first."""
        compiles = (self.warmup, self.warmup_all, self.background_compile)
        return EngineOptions(engine_args, self.limits.max_queue, *compiles, self.uvicorn_log_level)


def serve(engine_args: EngineArgs | None = None, options: ServeOptions | None = None) -> None:
    """Load the model and serve it until interrupted. Bad options raise ValueError before the
    model loads. Before it answers the server compiles the common programs (``warmup``), or
    every program (``warmup_all``), or nothing; with ``background_compile`` the rest compile on
    a background thread once it answers, else each on first use. ``lora_modules``: (name, path)
    LoRA adapters served from the start (needs ``enable_lora``); ``lora_updates``: those loaded
    at run time, and from where (pagedjax/lora/updates.py). With ``engine_process`` the engine
    runs in a process of its own (engine/hosting/engine_process.py): this one only serves HTTP,
    so its parsing, tokenizing and response building never hold the engine's GIL."""
    import uvicorn

    from pagedjax.models.loader import default_model_path

    engine_args = engine_args or EngineArgs()
    o = options or ServeOptions()
    if o.lora_modules and not engine_args.enable_lora:
        raise ValueError("lora_modules (--lora-modules) needs enable_lora (--enable-lora)")
    # The id clients use: the aliases given, else the name the user passed (not a resolved
    # cache path), else the embedded model's file name.
    names = o.served_model_name or engine_args.model or Path(default_model_path()).stem
    log_to_stderr(o.uvicorn_log_level)
    served = launch_server(o.engine_options(engine_args), names, o, engine_process=o.engine_process)
    if served is None:  # a follower of a multi-process run: it has replayed the driver's steps
        return
    client, app = served
    try:
        uvicorn.run(_logged(app, o), **o.uvicorn_kwargs())
    finally:
        client.close()  # in a multi-process run this stops the followers


def _logged(app, o: ServeOptions):
    """The app, wrapped to log each request when ``enable_log_requests``."""
    return RequestLog(app, o.max_log_len) if o.enable_log_requests else app
