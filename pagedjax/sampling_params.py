"""SamplingParams: how one request is decoded (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # <= 0 (or -1, vLLM's spelling) = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # a seeded request samples the same tokens whatever shares its batch
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not self.temperature >= 0:
            bad("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (-1 or 0 disables it)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            bad("seed", "must be an integer in [0, 2**32)")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
