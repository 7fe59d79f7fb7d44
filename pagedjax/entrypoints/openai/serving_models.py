"""The models the server serves (vLLM's OpenAIServingModels): the base model under its names,
and, with --enable-lora, LoRA adapters by name. A request's ``model`` naming an adapter runs
under it; /v1/models lists the adapters with the base model as ``parent``.

Adapters come from --lora-modules at start and, where run-time updates are on
(--enable-lora-runtime-updates or VLLM_ALLOW_RUNTIME_LORA_UPDATING: pagedjax/lora/updates.py),
from /v1/load_lora_adapter; each gets a fresh lora_int_id, never reused (the engine's prefix
cache keys blocks by it). Unloading takes the name away from new requests; requests in flight
finish under the adapter (the engine keeps it until they do: pagedjax/lora/manager.py).
"""

from __future__ import annotations

import itertools
import threading

from pagedjax.entrypoints.openai.protocol import APIError, bad_request
from pagedjax.lora.request import LoRARequest
from pagedjax.lora.updates import LoRAUpdates


def model_not_found(model_id: str, model_names: list[str], param: str = "model") -> APIError:
    return APIError(
        404,
        f"the model {model_id!r} does not exist; this server serves {model_names}",
        "invalid_request_error",
        "model_not_found",
        param,
    )


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry, ``name=path``, as (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes name=path entries, got {text!r}")
    return name.strip(), path.strip()


class ServedModels:
    """Names to what they run: None for the base model, a LoRARequest for an adapter. Read by
    the parsing threads, changed by the load/unload handlers: behind a lock."""

    def __init__(
        self, base_names: list[str], enable_lora: bool = False, updates: LoRAUpdates | None = None
    ):
        self.base_names = list(base_names)
        self.enable_lora = enable_lora
        self.updates = updates or LoRAUpdates()  # run-time loading: off unless asked for
        self._adapters: dict[str, LoRARequest] = {}
        self._pending: set[str] = set()  # names being loaded
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @classmethod
    def for_engine(
        cls, client, base_names: list[str], lora_modules=None, updates: LoRAUpdates | None = None
    ) -> ServedModels:
        """The server's models: LoRA is on when the engine serves adapters (``client``, an
        EngineClient); ``lora_modules`` ((name, path) pairs, --lora-modules) are loaded now, a
        bad one raising ValueError naming it; ``updates``: whether adapters load at run time,
        and from where."""
        models = cls(base_names, client.lora_enabled, updates)
        if lora_modules and not models.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in lora_modules or ():
            try:
                lora = models.reserve(name, path)
            except APIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
            try:
                client.add_lora(lora)
            except ValueError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
            models.register(lora)
        return models

    @property
    def runtime_updates(self) -> bool:
        """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served."""
        return self.enable_lora and self.updates.enabled

    @property
    def parent(self) -> str:
        """The base model's served name: every adapter's ``parent``."""
        return self.base_names[0]

    def names(self) -> list[str]:
        with self._lock:
            return [*self.base_names, *self._adapters]

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._adapters.values())

    def resolve(self, model: str, param: str = "model") -> LoRARequest | None:
        """What a request naming ``model`` runs under; 404 naming it if nothing here is."""
        with self._lock:
            if model in self.base_names:
                return None
            lora = self._adapters.get(model)
        if lora is None:
            raise model_not_found(model, self.names(), param)
        return lora

    def reserve(self, name: str, path: str) -> LoRARequest:
        """A new adapter's request with a fresh id; 400 if the name is taken. ``register`` it once
        the engine has loaded it, else ``release`` it."""
        if not name:
            raise bad_request("lora_name must not be empty", "lora_name")
        if not path:
            raise bad_request("lora_path must not be empty", "lora_path")
        with self._lock:
            if name in self.base_names or name in self._adapters or name in self._pending:
                raise bad_request(f"the LoRA adapter {name!r} has already been loaded", "lora_name")
            self._pending.add(name)
            return LoRARequest(name, next(self._ids), path)

    def register(self, lora: LoRARequest) -> None:
        with self._lock:
            self._pending.discard(lora.lora_name)
            self._adapters[lora.lora_name] = lora

    def release(self, lora: LoRARequest) -> None:
        with self._lock:
            self._pending.discard(lora.lora_name)

    def unregister(self, name: str) -> LoRARequest:
        """Take an adapter's name away; 404 naming it if no adapter has it."""
        with self._lock:
            lora = self._adapters.pop(name, None)
            loaded = sorted(self._adapters)
        if lora is None:
            raise APIError(
                404,
                f"the LoRA adapter {name!r} cannot be found; loaded: {loaded}",
                "invalid_request_error",
                "model_not_found",
                "lora_name",
            )
        return lora
