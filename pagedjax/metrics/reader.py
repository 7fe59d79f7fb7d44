"""vLLM's metric types (``vllm.v1.metrics.reader``): what ``LLM.get_metrics()`` returns, one
object per series, named as vLLM names them (``vllm:num_requests_running``, ...)."""

from __future__ import annotations

import dataclasses

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]


@dataclasses.dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    value: int


@dataclasses.dataclass
class Gauge(Metric):
    value: float


@dataclasses.dataclass
class Vector(Metric):
    """One count per position (vLLM's speculative decoding acceptances per proposal slot)."""

    values: list[int]


@dataclasses.dataclass
class Histogram(Metric):
    count: int
    sum: float
    # Each bucket's upper bound as text ("0.5", ..., "+Inf") -> observations at or below it
    buckets: dict[str, int]
