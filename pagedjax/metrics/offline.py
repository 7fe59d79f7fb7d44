"""What ``LLM.get_metrics()`` reports, under vLLM's names: the engine's gauges and counters (read
from its stats) and per-request counters and histograms of the requests LLM ran (a fixed set of
buckets each, so their memory does not grow with traffic)."""

from __future__ import annotations

import bisect
import time

from pagedjax.metrics.names import FINISHED_REASONS, buckets, full
from pagedjax.metrics.reader import Counter, Gauge, Histogram, Metric, Vector
from pagedjax.outputs import EngineStats, RequestOutput

# the histograms LLM keeps of its own requests (names and buckets: names.py, the server's too)
_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
)
TTFT, E2E = full("time_to_first_token_seconds"), full("e2e_request_latency_seconds")


class Buckets:
    """A histogram's counts over fixed upper bounds (and +Inf), its count and sum."""

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not yet cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def histogram(self, name: str, labels: dict[str, str]) -> Histogram:
        cumulative, total = {}, 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            cumulative[bound] = total
        return Histogram(name, dict(labels), total, self.sum, cumulative)


class RequestCounts:
    """Counters and histograms of finished requests (``observe`` each one's final output)."""

    def __init__(self, max_model_len: int, clock=time.monotonic):
        self._clock = clock
        self.histograms = {
            full(name): Buckets(buckets(name, max_model_len)) for name in _HISTOGRAMS
        }
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish reason -> requests

    def observe(self, out: RequestOutput, n: int, max_tokens: int) -> None:
        now = self._clock()
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens += len(out.prompt_token_ids)
        self.generation_tokens += generated
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self.finished[reason or "abort"] = self.finished.get(reason or "abort", 0) + 1
        h = self.histograms
        if out.metrics is not None:
            h[E2E].observe(now - out.metrics.arrival_time)
            if out.metrics.first_token_time is not None:
                ttft = out.metrics.first_token_time - out.metrics.arrival_time
                h[TTFT].observe(ttft)
        h[full("request_prompt_tokens")].observe(len(out.prompt_token_ids))
        h[full("request_generation_tokens")].observe(generated)
        h[full("request_params_n")].observe(n)
        h[full("request_params_max_tokens")].observe(max_tokens)

    def metrics(self, labels: dict[str, str]) -> list[Metric]:
        out: list[Metric] = [
            Counter(full("prompt_tokens"), dict(labels), self.prompt_tokens),
            Counter(full("generation_tokens"), dict(labels), self.generation_tokens),
        ]
        for reason in FINISHED_REASONS:
            count = self.finished.get(reason, 0)
            out.append(
                Counter(full("request_success"), labels | {"finished_reason": reason}, count)
            )
        out += [b.histogram(name, labels) for name, b in self.histograms.items()]
        return out


def engine_metrics(stats: EngineStats, labels: dict[str, str], block_size: int = 1) -> list[Metric]:
    """The engine's gauges and counters, from its stats (prefix-cache blocks counted in tokens,
    ``block_size`` each, as vLLM and the server count them)."""
    usage = stats.num_blocks_used / max(stats.num_blocks_total, 1)
    out: list[Metric] = [
        Gauge(full("num_requests_running"), dict(labels), stats.num_requests_running),
        Gauge(full("num_requests_waiting"), dict(labels), stats.num_requests_waiting),
        Gauge(full("kv_cache_usage_perc"), dict(labels), usage),
        Counter(full("num_preemptions"), dict(labels), stats.num_preemptions),
        Counter(
            full("prefix_cache_queries"), dict(labels), stats.prefix_cache_queries * block_size
        ),
        Counter(full("prefix_cache_hits"), dict(labels), stats.prefix_cache_hits * block_size),
    ]
    spec = stats.spec_decoding
    if spec is not None:
        out += [
            Counter(full("spec_decode_num_drafts"), dict(labels), spec.num_drafts),
            Counter(full("spec_decode_num_draft_tokens"), dict(labels), spec.num_draft_tokens),
            Counter(
                full("spec_decode_num_accepted_tokens"), dict(labels), spec.num_accepted_tokens
            ),
            Vector(
                full("spec_decode_num_accepted_tokens_per_pos"),
                dict(labels),
                list(spec.num_accepted_tokens_per_pos),
            ),
        ]
    return out
