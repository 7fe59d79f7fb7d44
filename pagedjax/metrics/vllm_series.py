"""The server's metrics under vLLM's names (``vllm:...``), labelled ``model_name`` (the first
served name) and ``engine`` ("0"), as vLLM V1's Prometheus logger exports them, so that vLLM's
Grafana dashboards and alerts read a pagedjax server unchanged. They stand beside the
``pagedjax_`` names (server.py).

- Gauges and engine counters (requests running and waiting, KV cache usage, preemptions, prefix
  cache queries and hits in tokens, speculative decoding) come from the engine's stats snapshot
  at scrape time (``engine_families``).
- Per-request counters and histograms are updated on the engine thread (``VllmRequestMetrics``):
  at admission (prompt tokens), at the first token (time to first token), after every step (the
  gap between each running request's tokens: inter-token latency), and at the finish (end to
  end latency, queue, prefill, decode and inference time, prompt and generation lengths, the
  request's n and max_tokens, success by finish reason).

Every histogram has a fixed set of buckets (vLLM's), so memory does not grow with traffic.
The names, helps and buckets are pagedjax/metrics/names.py's, which ``LLM.get_metrics()`` reads
too; ``VLLM_METRIC_NAMES`` lists every name this module exports.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedjax.metrics import names
from pagedjax.outputs import EngineStats, RequestOutput

# the names, helps and buckets: pagedjax/metrics/names.py (LLM.get_metrics() reads them too)
_HISTOGRAMS, _COUNTERS, _GAUGES = names.HISTOGRAMS, names.COUNTERS, names.GAUGES
_ENGINE_COUNTERS, _SPEC_COUNTERS = names.ENGINE_COUNTERS, names.SPEC_COUNTERS
LABELS, FINISHED_REASONS, VLLM_METRIC_NAMES = names.LABELS, names.FINISHED_REASONS, names.ALL
one_two_five = names.one_two_five


class VllmRequestMetrics:
    """The per-request counters and histograms, in ``registry``; every series is labelled with
    ``model_name`` (``set_model_name``, before the server answers) and ``engine``."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int):
        self.histograms = {
            name: Histogram(
                "vllm:" + name,
                help_,
                LABELS,
                buckets=names.buckets(name, max_model_len),
                registry=registry,
            )
            for name, help_, _ in _HISTOGRAMS
        }
        self.counters = {
            name: Counter("vllm:" + name, help_, LABELS, registry=registry)
            for name, help_ in _COUNTERS
        }
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        self.model_name = ""
        self._children: dict = {}
        self.set_model_name("pagedjax")

    def set_model_name(self, name: str) -> None:
        """Label every series with ``name`` (the series under the name before are dropped)."""
        for metric in (*self.histograms.values(), *self.counters.values(), self.success):
            metric.clear()
        self.model_name = name
        labels = {"model_name": name, "engine": "0"}
        self._children = {k: m.labels(**labels) for k, m in self.histograms.items()}
        self._children.update({k: m.labels(**labels) for k, m in self.counters.items()})
        for reason in FINISHED_REASONS:  # vLLM exports every reason from the start
            self._children[reason] = self.success.labels(**labels, finished_reason=reason)

    def observe(self, name: str, value: float) -> None:
        self._children[name].observe(value)

    def inc(self, name: str, value: float = 1) -> None:
        self._children[name].inc(value)

    def token_gaps(self, gaps: list[float]) -> None:
        """One step's gaps between each running request's tokens (inter-token latencies)."""
        for gap in gaps:
            self.observe("inter_token_latency_seconds", gap)
            self.observe("time_per_output_token_seconds", gap)

    def first_token(self, t, out: RequestOutput, now: float) -> None:
        """``t``: what the engine loop tracks of the request (``arrival``, ``n``,
        ``max_tokens``, ``first_token``: set here)."""
        first = out.metrics.first_token_time if out.metrics is not None else None
        t.first_token = now if first is None else first
        self.observe("time_to_first_token_seconds", t.first_token - _arrival(t, out))

    def finished(self, t, out: RequestOutput, now: float) -> None:
        """A finished request's histograms and its success, one per completion by reason."""
        arrival = _arrival(t, out)
        lengths = [len(c.token_ids) for c in out.outputs]
        generated = sum(lengths)
        self.observe("e2e_request_latency_seconds", now - arrival)
        self.observe("request_prompt_tokens", len(out.prompt_token_ids))
        self.observe("request_generation_tokens", generated)
        self.observe("request_max_num_generation_tokens", max(lengths, default=0))
        self.observe("request_params_n", t.n)
        self.observe("request_params_max_tokens", t.max_tokens)
        scheduled = out.metrics.first_scheduled_time if out.metrics is not None else None
        if scheduled is not None:
            self.observe("request_queue_time_seconds", scheduled - arrival)
            self.observe("request_inference_time_seconds", now - scheduled)
            if t.first_token is not None:
                self.observe("request_prefill_time_seconds", t.first_token - scheduled)
        if t.first_token is not None:
            self.observe("request_decode_time_seconds", now - t.first_token)
            longest = max(lengths, default=0)
            if longest > 1:
                tpot = (now - t.first_token) / (longest - 1)
                self.observe("request_time_per_output_token_seconds", tpot)
        for c in out.outputs:
            self.finished_reason(c.finish_reason or "abort")

    def finished_reason(self, reason: str) -> None:
        child = self._children.get(reason)
        if child is None:  # a reason of the future: its own series
            labels = {"model_name": self.model_name, "engine": "0", "finished_reason": reason}
            child = self._children[reason] = self.success.labels(**labels)
        child.inc()


def _arrival(t, out: RequestOutput) -> float:
    """The engine's arrival time (its clock is the one the first-token time is on)."""
    return out.metrics.arrival_time if out.metrics is not None else t.arrival


def engine_families(stats: EngineStats, model_name: str, block_size: int):
    """The vllm: gauges and engine counters of a stats snapshot (at scrape time)."""
    labels = [model_name, "0"]
    values = {
        "num_requests_running": stats.num_requests_running,
        "num_requests_waiting": stats.num_requests_waiting,
        "kv_cache_usage_perc": stats.num_blocks_used / max(stats.num_blocks_total, 1),
        "num_preemptions": stats.num_preemptions,
        # the engine counts full blocks; vLLM counts their tokens
        "prefix_cache_queries": stats.prefix_cache_queries * block_size,
        "prefix_cache_hits": stats.prefix_cache_hits * block_size,
    }
    for family, specs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _ENGINE_COUNTERS)):
        for name, help_ in specs:
            metric = family("vllm:" + name, help_, labels=LABELS)
            metric.add_metric(labels, values[name])
            yield metric
    spec = stats.spec_decoding
    if spec is not None:
        counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        for (name, help_), value in zip(_SPEC_COUNTERS, counts, strict=True):
            metric = CounterMetricFamily("vllm:" + name, help_, labels=LABELS)
            metric.add_metric(labels, value)
            yield metric
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for i, n in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([*labels, str(i)], n)
        yield per_pos


def cache_config_info(cache, stats: EngineStats) -> GaugeMetricFamily:
    """vLLM's cache_config_info: the KV cache's settings (``cache``: a CacheConfig) as labels,
    value 1."""
    fields = {
        "block_size": cache.block_size,
        "cache_dtype": stats.kv_cache_dtype or cache.kv_cache_dtype,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "num_gpu_blocks": stats.num_blocks_total,
        "swap_space": cache.swap_space_gib,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
    }
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(fields)
    )
    info.add_metric([str(v) for v in fields.values()], 1)
    return info
