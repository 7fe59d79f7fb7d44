"""What a front end needs of a serving engine, wherever the engine runs (vLLM's
``engine/protocol.py``): ``EngineClient``. The OpenAI server (``build_app``) and the Ray Serve
replicas code against it; two hosts implement it:

- ``engine/hosting/engine_loop.py``'s ``EngineLoop``: the engine on a thread of this process;
- ``engine/hosting/engine_client.py``'s ``EngineProcess``: the engine in a process of its own
  (``pagedjax serve --engine-process``), read here from what it sent when it was ready.

A client answers, before and while anything runs: what it serves (tokenizer, model config, the
engine's config and limits, default sampling parameters, whether LoRA adapters are served);
request checks on any thread (the admission check, a structured-output constraint compiled);
and it runs requests: ``submit`` and ``abort``, named ``command``s between steps (loading and
unloading adapters), ``start`` / ``stop``, ``is_running`` (health) and ``metrics``.
"""

from __future__ import annotations

import abc
import concurrent.futures

DEFAULT_MAX_QUEUE = 256  # requests that may wait for admission before new ones are refused

# What ``command`` may run on the engine, by name: a name and its arguments pickle, so the same
# command reaches an engine in another process.
ENGINE_COMMANDS = frozenset({"add_lora", "remove_lora"})


class QueueFull(Exception):
    """The engine's waiting queue is at the server's limit (``max_queue``)."""


class EngineClient(abc.ABC):
    """A serving engine as a front end sees it (module docstring)."""

    metrics: object  # the server's metrics: ``metrics.render()`` is /metrics' exposition

    # ---- what it serves (read before anything runs) -----------------------------------------

    @property
    @abc.abstractmethod
    def tokenizer(self):
        """The model's tokenizer (transformers'; None for a model without one). Not shareable
        across threads: a front end works on its own copy."""

    @property
    @abc.abstractmethod
    def model_config(self):
        """The model's ModelConfig (its vocabulary, context)."""

    @property
    @abc.abstractmethod
    def config(self):
        """The engine's EngineConfig: its limits (``scheduler.max_model_len``, ...) and LoRA's."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    @abc.abstractmethod
    def default_sampling_params(self) -> dict:
        """SamplingParams fields a request gets unless it sets them (the generation config)."""

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (enable_lora)."""
        return self.config.lora is not None

    # ---- request checks (any thread) ----------------------------------------------------------

    @abc.abstractmethod
    def check_request(self, prompt_token_ids: list[int], params) -> None:
        """The engine's admission check: ValueError, naming the limit, for a request it could
        never run (LLMEngine.check_request)."""

    @abc.abstractmethod
    def compile_grammar(self, constraint):
        """Compile a structured-output constraint with the engine's grammar compiler (cached);
        ValueError naming what is wrong with it."""

    # ---- running requests -------------------------------------------------------------------

    @abc.abstractmethod
    def submit(
        self, requests: list[tuple], params, lora_request=None, priority: int = 0
    ) -> list[concurrent.futures.Future]:
        """Add ``requests`` ((request id, prompt ids, sink) each, all with ``params`` and
        ``priority``, under the adapter ``lora_request`` if given), taken by the engine between
        the same two steps; each request's outputs (or an exception) go to its ``sink``, on
        another thread. One future per request: it fails with ValueError (a bad request),
        QueueFull, or RuntimeError."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request; nothing more reaches its sink."""

    @abc.abstractmethod
    def command(self, name: str, *args) -> concurrent.futures.Future:
        """Run the engine's command ``name`` (one of ENGINE_COMMANDS) on ``args`` between
        steps; the future holds its result or exception."""

    def add_lora(self, lora_request) -> bool:
        """Load an adapter (--lora-modules at start); ValueError as the engine's."""
        return self.command("add_lora", lora_request).result()

    # ---- life and health ------------------------------------------------------------------

    @abc.abstractmethod
    def start(self) -> None:
        """The server is about to answer: the engine steps from now on."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop stepping; requests in flight get the shutdown error."""

    @abc.abstractmethod
    def close(self) -> None:
        """After ``stop``: free the engine (its device memory, its process), unless a step
        outlived the shutdown."""

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """Whether the engine steps (health: a request waiting on a stopped engine would wait
        forever)."""


def check_command(name: str) -> None:
    if name not in ENGINE_COMMANDS:
        raise ValueError(f"unknown engine command {name!r}; known: {sorted(ENGINE_COMMANDS)}")
