"""SpeculativeConfig: vLLM's ``speculative_config`` dict, validated once (pure Python)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # proposals per sequence and step


def _int_at_least(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative_config {name} must be an integer >= {low}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates. ``"ngram"`` (prompt lookup): propose the
    ``num_speculative_tokens`` tokens that followed the longest earlier occurrence (between
    ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens long) of the sequence's own suffix.
    As in vLLM, a missing bound takes the other's value, and both default to 5.
    ``"draft_model"``: ``model`` (a path or hub id, with the target's vocabulary) proposes
    ``num_speculative_tokens`` tokens, one decode step each (spec_decode/draft.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # the draft model (method "draft_model")

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {METHODS}, got {self.method!r}"
            )
        k = _int_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {k}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    f"speculative_config method 'draft_model' needs a model path, "
                    f"got model={self.model!r}"
                )
            if lo is not None or hi is not None:
                raise ValueError("speculative_config prompt_lookup_* are for method 'ngram'")
            return
        if self.model is not None:
            raise ValueError(
                f"speculative_config model is for method 'draft_model', got method {self.method!r}"
            )
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        object.__setattr__(self, "prompt_lookup_min", _int_at_least("prompt_lookup_min", lo, 1))
        object.__setattr__(self, "prompt_lookup_max", _int_at_least("prompt_lookup_max", hi, 1))
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping | None) -> SpeculativeConfig | None:
        """From a dict (vLLM's keys; an unknown key is refused by name), a config, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict or None, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown} (known: {sorted(names)})"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config needs {name!r}, got {dict(value)!r}")
        return cls(**value)
