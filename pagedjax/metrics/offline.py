"""What ``LLM.get_metrics()`` reports, under vLLM's names: the engine's gauges and counters (read
from its stats) and per-request counters and histograms of the requests LLM ran (a fixed set of
buckets each, so their memory does not grow with traffic)."""

from __future__ import annotations

import bisect
import time

from pagedjax.metrics.reader import Counter, Gauge, Histogram, Metric, Vector
from pagedjax.outputs import EngineStats, RequestOutput

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
E2E_BUCKETS += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


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
        tokens = one_two_five(max_model_len)
        self._clock = clock
        self.histograms = {
            "vllm:time_to_first_token_seconds": Buckets(TTFT_BUCKETS),
            "vllm:e2e_request_latency_seconds": Buckets(E2E_BUCKETS),
            "vllm:request_prompt_tokens": Buckets(tokens),
            "vllm:request_generation_tokens": Buckets(tokens),
            "vllm:request_params_n": Buckets(N_BUCKETS),
            "vllm:request_params_max_tokens": Buckets(tokens),
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
            h["vllm:e2e_request_latency_seconds"].observe(now - out.metrics.arrival_time)
            if out.metrics.first_token_time is not None:
                ttft = out.metrics.first_token_time - out.metrics.arrival_time
                h["vllm:time_to_first_token_seconds"].observe(ttft)
        h["vllm:request_prompt_tokens"].observe(len(out.prompt_token_ids))
        h["vllm:request_generation_tokens"].observe(generated)
        h["vllm:request_params_n"].observe(n)
        h["vllm:request_params_max_tokens"].observe(max_tokens)

    def metrics(self, labels: dict[str, str]) -> list[Metric]:
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", dict(labels), self.prompt_tokens),
            Counter("vllm:generation_tokens", dict(labels), self.generation_tokens),
        ]
        for reason in ("stop", "length", "abort"):
            count = self.finished.get(reason, 0)
            out.append(Counter("vllm:request_success", labels | {"finished_reason": reason}, count))
        out += [b.histogram(name, labels) for name, b in self.histograms.items()]
        return out


def engine_metrics(stats: EngineStats, labels: dict[str, str]) -> list[Metric]:
    """The engine's gauges and counters, from its stats."""
    usage = stats.num_blocks_used / max(stats.num_blocks_total, 1)
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), stats.num_requests_running),
        Gauge("vllm:num_requests_waiting", dict(labels), stats.num_requests_waiting),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), usage),
        Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions),
        Counter("vllm:prefix_cache_queries", dict(labels), stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), stats.prefix_cache_hits),
    ]
    spec = stats.spec_decoding
    if spec is not None:
        out += [
            Counter("vllm:spec_decode_num_drafts", dict(labels), spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", dict(labels), spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), spec.num_accepted_tokens),
            Vector(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                dict(labels),
                list(spec.num_accepted_tokens_per_pos),
            ),
        ]
    return out
