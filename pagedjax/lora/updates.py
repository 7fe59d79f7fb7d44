"""Run-time adapter loading, opt-in as in vLLM: whether a server serves /v1/load_lora_adapter and
/v1/unload_lora_adapter, and which directories an adapter loaded through them may come from.

Off unless asked for: ``pagedjax serve --enable-lora-runtime-updates`` or vLLM's environment
variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` ("1" or "true"). ``--lora-allowed-roots DIR ...``
confines the paths to those directories (symbolic links resolved, the adapter's files
included). A path a client names is checked before anything reads it (``check_path``), and
every unusable path (missing, not a directory, no adapter files, unreadable, outside the roots)
gets one message, so that the answers do not tell a client what exists on the server. Adapters
given at start (--lora-modules) are the operator's: no roots, and the loader's own messages.

Pure Python; imports no jax.
"""

from __future__ import annotations

import dataclasses
import os

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def env_allows_runtime_updates() -> bool:
    """vLLM's switch: VLLM_ALLOW_RUNTIME_LORA_UPDATING set to "1" or "true" (any case)."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class LoRAUpdates:
    """``enabled``: the load and unload endpoints are served. ``allowed_roots``: directories a
    loaded adapter must lie under (stored resolved; empty: wherever the server can read)."""

    enabled: bool = False
    allowed_roots: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        roots = self.allowed_roots
        if isinstance(roots, str) or not all(isinstance(r, str) and r for r in roots):
            raise ValueError(f"allowed_roots must be a list of directories, got {roots!r}")
        if roots and not self.enabled:
            raise ValueError(
                "--lora-allowed-roots confines run-time adapter loading, which is off: add "
                f"--enable-lora-runtime-updates (or set {RUNTIME_UPDATES_ENV}=1)"
            )
        for root in roots:
            if not os.path.isdir(root):
                raise ValueError(f"--lora-allowed-roots: {root!r} is not a directory")
        object.__setattr__(self, "allowed_roots", tuple(os.path.realpath(r) for r in roots))

    @classmethod
    def from_options(cls, enabled: bool = False, allowed_roots=()) -> LoRAUpdates:
        """The flag's value, or vLLM's environment variable; the roots as given."""
        return cls(bool(enabled) or env_allows_runtime_updates(), tuple(allowed_roots or ()))

    def check_path(self, path: str) -> str:
        """``path`` resolved, if it is an adapter directory the server may load from; else a
        ValueError that says the same for every reason."""
        real = os.path.realpath(path)
        files = [os.path.join(real, ADAPTER_CONFIG)]
        files += [w for f in WEIGHT_FILES if os.path.isfile(w := os.path.join(real, f))][:1]
        usable = (
            os.path.isdir(real)
            and os.access(real, os.R_OK | os.X_OK)
            and len(files) == 2
            and all(os.path.isfile(f) and os.access(f, os.R_OK) for f in files)
            and all(self._allowed(os.path.realpath(p)) for p in (real, *files))
        )
        if not usable:
            where = f" under {list(self.allowed_roots)}" if self.allowed_roots else ""
            raise ValueError(
                f"lora_path {path!r} is not a LoRA adapter directory{where} that this server can "
                f"read ({ADAPTER_CONFIG} and one of {list(WEIGHT_FILES)})"
            )
        return real

    def _allowed(self, real: str) -> bool:
        return not self.allowed_roots or any(
            os.path.commonpath([real, root]) == root for root in self.allowed_roots
        )
