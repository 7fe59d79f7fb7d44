"""Where a server's own log lines go (the API process's and the engine process's alike)."""

from __future__ import annotations

import logging
import os


def log_to_stderr(level: str) -> None:
    """pagedjax's own lines (the start's figures, engine failures) beside uvicorn's, at its
    level, unless the application configured logging itself."""
    root = logging.getLogger("pagedjax")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    root.addHandler(handler)
    number = logging.getLevelName(level.upper())  # uvicorn's "trace" is not logging's
    root.setLevel(number if isinstance(number, int) else logging.DEBUG)


def configure_default_logging() -> None:
    """pagedjax's INFO lines (the model's load, the engine's start) to stderr, as vLLM logs
    its own, unless the application configured logging or PAGEDJAX_CONFIGURE_LOGGING=0."""
    if os.environ.get("PAGEDJAX_CONFIGURE_LOGGING", "1") != "0":
        log_to_stderr("info")
