"""The one start of a serving engine and its OpenAI app: ``pagedjax serve`` (the engine on a
thread of the server's process, or with ``--engine-process`` in a process of its own) and each
Ray Serve replica go through ``launch_server``.

The engine side is engine/hosting/startup.py's ``start_engine`` (the engine of an EngineArgs,
its programs compiled before the server answers, its in-thread host with the start attached,
the follower's part of a multi-process run), which the engine process runs too; here the
engine's client (engine/client.py) gets the app over it and the body checker's workers.
"""

from __future__ import annotations

from fastapi import FastAPI

from pagedjax.engine.client import EngineClient
from pagedjax.engine.hosting.engine_client import EngineProcess
from pagedjax.engine.hosting.startup import EngineOptions, start_engine
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.entrypoints.openai.serving import build_app


def launch_engine(options: EngineOptions, *, engine_process: bool = False) -> EngineClient | None:
    """The serving engine of ``options``, ready to answer: its client, on a thread of this
    process or (``engine_process``) in a process of its own. None in a follower process of a
    multi-process run, once its engine has replayed the driver's steps to the end."""
    if not engine_process:
        return start_engine(options)
    client = EngineProcess(options)
    try:
        if client.wait_ready():
            return client
        client.join()  # a follower of a multi-process run: its engine replays the driver's
        return None
    except BaseException:
        client.close()
        raise


def launch_server(
    options: EngineOptions,
    served_model_name: str | list[str],
    app_options: AppOptions | None = None,
    *,
    engine_process: bool = False,
) -> tuple[EngineClient, FastAPI] | None:
    """The engine launched (``launch_engine``) and its OpenAI app (``build_app`` with
    ``app_options``), the body checker's workers started so that they are ready before big
    bodies come. None in a follower process. The caller runs the app, then closes the client
    (``EngineClient.close``); a failure here closes it."""
    client = launch_engine(options, engine_process=engine_process)
    if client is None:
        return None
    try:
        app = build_app(client, served_model_name, app_options)
        app.state.offload.checker.start()
    except BaseException:
        client.stop()
        client.close()
        raise
    return client, app
