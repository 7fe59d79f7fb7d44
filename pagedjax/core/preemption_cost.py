"""Whether swapping a preempted group out and back in costs less than recomputing its tokens
(the paper's section 7.3), from measured step times; ``preemption_mode="auto"`` asks it.
Pure Python; imports no jax."""

from __future__ import annotations


class PreemptionCostModel:
    """Estimates, from measured step times, whether swapping a group out and back in costs less
    than recomputing its tokens. Until both are measured: recompute."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds_per_token: float | None = None  # prefill compute
        self.seconds_per_block: float | None = None  # one block moved one way

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self.seconds_per_token = self._ema(self.seconds_per_token, seconds / num_tokens)

    def observe_swap(self, seconds: float, num_blocks: int) -> None:
        if num_blocks:
            self.seconds_per_block = self._ema(self.seconds_per_block, seconds / num_blocks)

    def prefer_swap(self, num_tokens: int, num_blocks: int) -> bool:
        if self.seconds_per_token is None or self.seconds_per_block is None:
            return False
        return 2 * num_blocks * self.seconds_per_block < num_tokens * self.seconds_per_token
