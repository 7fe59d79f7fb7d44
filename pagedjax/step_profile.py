"""Where a step's time goes, and how much of its work is padding.

Padding counts are always kept (they are cheap): per step kind (prefill, mixed, decode), real vs
padded token rows, and real vs padded attention work (query rows x keys the attention path
computes). Phase timing is on only while ``enabled``: then the runner waits for the device at the
end of each phase, so the split is exact but the host and the device no longer overlap (a
profiled run is slower than a plain one; its total is not a throughput figure).

Phases: ``schedule`` (scheduler, block moves), ``build`` (StepInput and sampling inputs, host),
``device`` (the model step and sampler until their results are ready), ``fetch`` (sampler output
to the host), ``update`` (append tokens, fork, stop), ``output`` (detokenize, stop strings,
RequestOutputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

PHASES = ("schedule", "build", "device", "fetch", "update", "output")


@dataclasses.dataclass
class KindCounts:
    steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    real_attention: int = 0  # sum over sequences of query rows x context keys
    padded_attention: int = 0  # what the attention path computes for the padded shape
    device_seconds: float = 0.0  # with timing on


class StepProfile:
    def __init__(self):
        self.enabled = False
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.kinds: dict[str, KindCounts] = {}
        self.wall_seconds = 0.0  # steps' wall time while enabled

    @contextlib.contextmanager
    def phase(self, name: str, kind: str | None = None):
        """Time the block as phase ``name``; with a step ``kind`` (as ``count`` named it: the
        runner passes one for its device phases) the time is also that kind's device time."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[name] += elapsed
            if kind is not None:
                self.kinds.setdefault(kind, KindCounts()).device_seconds += elapsed

    def count(self, kind: str, real_tokens: int, padded_tokens: int, real_attn, padded_attn):
        k = self.kinds.setdefault(kind, KindCounts())
        k.steps += 1
        k.real_tokens += real_tokens
        k.padded_tokens += padded_tokens
        k.real_attention += real_attn
        k.padded_attention += padded_attn

    @property
    def token_padding_ratio(self) -> float:
        """Padded token rows computed per real one, over every step (1.0: no padding)."""
        real = sum(k.real_tokens for k in self.kinds.values())
        return sum(k.padded_tokens for k in self.kinds.values()) / real if real else 1.0

    @property
    def attention_padding_ratio(self) -> float:
        real = sum(k.real_attention for k in self.kinds.values())
        return sum(k.padded_attention for k in self.kinds.values()) / real if real else 1.0

    def reset(self) -> None:
        self.__init__()

    def report(self) -> dict:
        timed = sum(self.seconds.values())
        return {
            "phases_s": dict(self.seconds),
            "phases_share": {k: v / timed for k, v in self.seconds.items()} if timed else {},
            "kinds": {k: dataclasses.asdict(v) for k, v in self.kinds.items()},
            "token_padding_ratio": self.token_padding_ratio,
            "attention_padding_ratio": self.attention_padding_ratio,
        }
