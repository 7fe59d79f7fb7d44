"""The server's Prometheus metrics, through ``prometheus_client``.

Each app has its own registry (several apps may live in one process, as in tests). The server's
own counters and latency histograms are ``prometheus_client`` metrics updated on the engine
thread; the engine's state (queues, KV blocks, preemptions) is read from a
snapshot of ``engine.get_stats()`` that the engine thread refreshes every loop, and exposed by a
collector at scrape time. Handlers never read the scheduler's queues. The programs compiled and
the seconds it took are read at scrape time instead (``compile_counts``): a server's background
compile adds to them on a thread of its own, between the engine's passes.

The same figures are also exported under vLLM's names (``vllm:...``, labelled ``model_name``),
with vLLM's request histograms: vllm_series.py.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedjax.metrics import vllm_series
from pagedjax.outputs import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# name, help, how to read it from EngineStats
_GAUGES = (
    ("num_requests_running", "Requests running.", lambda s: s.num_requests_running),
    ("num_requests_waiting", "Requests waiting.", lambda s: s.num_requests_waiting),
    ("num_requests_swapped", "Requests swapped.", lambda s: s.num_requests_swapped),
    ("kv_blocks_total", "Allocatable KV blocks.", lambda s: s.num_blocks_total),
    ("kv_blocks_used", "KV blocks in use.", lambda s: s.num_blocks_used),
    (
        "kv_cache_usage_ratio",
        "Used / total KV blocks.",
        lambda s: s.num_blocks_used / max(s.num_blocks_total, 1),
    ),
    ("prefix_cache_hit_rate", "Prefix cache hits / lookups.", lambda s: s.prefix_cache_hit_rate),
    (
        "token_padding_ratio",
        "Token rows computed (padding included) per real token, over every step.",
        lambda s: s.token_padding_ratio,
    ),
    (
        "attention_padding_ratio",
        "Attention work computed (padding included) per real query-key pair, over every step.",
        lambda s: s.attention_padding_ratio,
    ),
)
_COUNTERS = (
    ("num_preemptions", "Preemptions.", lambda s: s.num_preemptions),
    ("prefix_cache_queries", "Prefix cache lookups.", lambda s: s.prefix_cache_queries),
    ("prefix_cache_hits", "Prefix cache hits.", lambda s: s.prefix_cache_hits),
    ("compilations", "Programs compiled.", lambda s: s.num_compilations),
    ("compile_seconds", "Seconds spent compiling.", lambda s: s.compile_seconds),
    ("engine_aborts", "Requests the engine ended itself, with a reason.", lambda s: s.num_aborted),
)


class _EngineCollector:
    """Exposes the latest engine stats snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self):
        stats = self._metrics.engine_stats
        if stats is None:
            return
        if self._metrics.compile_counts is not None:
            programs, seconds = self._metrics.compile_counts()
            stats = dataclasses.replace(stats, num_compilations=programs, compile_seconds=seconds)
        for name, help_, read in _GAUGES:
            yield GaugeMetricFamily(f"pagedjax_{name}", help_, value=read(stats))
        for name, help_, read in _COUNTERS:
            yield CounterMetricFamily(f"pagedjax_{name}", help_, value=read(stats))
        yield from self._vllm_families(stats)
        if stats.kv_cache_dtype:  # vLLM's cache_config_info: the settings as labels, value 1
            info = GaugeMetricFamily(
                "pagedjax_cache_config_info", "The KV cache's settings.", labels=["kv_cache_dtype"]
            )
            info.add_metric([stats.kv_cache_dtype], 1)
            yield info
        yield from _step_profile_metrics(stats)
        spec = stats.spec_decoding  # only when the engine speculates (vLLM's spec_decode_*)
        for name, help_, value in _spec_decode_metrics(spec) if spec is not None else ():
            family = CounterMetricFamily if isinstance(value, int) else GaugeMetricFamily
            yield family(f"pagedjax_spec_decode_{name}", help_, value=value)
        if self._metrics.lora_info is not None:  # vLLM's lora_requests_info: names as labels
            running, waiting = self._metrics.lora_info
            info = GaugeMetricFamily(
                "pagedjax_lora_requests_info",
                "The LoRA adapters of the running and the waiting requests (value 1).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            info.add_metric([str(self._metrics.max_loras), ",".join(running), ",".join(waiting)], 1)
            yield info
        if spec is not None:
            per_pos = CounterMetricFamily(
                "pagedjax_spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose proposal at this position was accepted.",
                labels=["position"],
            )
            for i, n in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([str(i)], n)
            yield per_pos

    def _vllm_families(self, stats: EngineStats):
        m = self._metrics
        yield from vllm_series.engine_families(stats, m.model_name, m.block_size)
        if m.cache_config is not None:
            yield vllm_series.cache_config_info(m.cache_config, stats)
        if m.lora_info is not None:
            running, waiting = m.lora_info
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            info.add_metric([str(m.max_loras), ",".join(running), ",".join(waiting)], 1)
            yield info


# The step profile's figures per step kind, while its timing is on: field, metric, help
_STEP_KIND_GAUGES = (
    ("host_ms", "step_host_milliseconds", "Host milliseconds per step (profiled steps)."),
    ("device_ms", "step_device_milliseconds", "Device milliseconds per step (profiled steps)."),
    (
        "mbu",
        "step_mbu",
        "Memory-bandwidth utilization: bytes a step reads / its device time / copy bandwidth.",
    ),
)


def _step_profile_metrics(stats: EngineStats):
    if not stats.step_kinds:
        return
    for field, name, help_ in _STEP_KIND_GAUGES:
        family = GaugeMetricFamily(f"pagedjax_{name}", help_, labels=["step_kind"])
        for kind, row in stats.step_kinds.items():
            if row.get(field) is not None:
                family.add_metric([kind], row[field])
        yield family
    if stats.copy_gbps is not None:
        yield GaugeMetricFamily(
            "pagedjax_copy_bandwidth_gbps",
            "Copy bandwidth MBU divides by, measured when the profile's timing was switched on.",
            value=stats.copy_gbps,
        )


def _spec_decode_metrics(s):
    return (
        ("num_drafts", "Sequences' proposals verified (one per sequence and step).", s.num_drafts),
        ("num_draft_tokens", "Proposed tokens verified.", s.num_draft_tokens),
        ("num_accepted_tokens", "Proposed tokens accepted.", s.num_accepted_tokens),
        ("acceptance_rate", "Accepted / proposed tokens.", s.acceptance_rate),
        (
            "mean_acceptance_length",
            "Tokens per verification step: 1 + accepted / drafts.",
            s.mean_acceptance_length,
        ),
    )


class ServerMetrics:
    """The metrics of one app: updated by the engine thread, rendered by /metrics."""

    def __init__(self, max_model_len: int = 2048, block_size: int = 16, cache_config=None):
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.block_size = block_size  # the engine counts prefix-cache blocks, vLLM tokens
        self.cache_config = cache_config  # vllm:cache_config_info's labels (None: not shown)
        self.vllm = vllm_series.VllmRequestMetrics(reg, max_model_len)
        self.prompt_tokens = Counter(
            "pagedjax_prompt_tokens", "Prompt tokens admitted.", registry=reg
        )
        self.generation_tokens = Counter(
            "pagedjax_generation_tokens", "Tokens generated.", registry=reg
        )
        self._generation_base: int | None = None  # the engine's count at the last publish
        self.request_errors = Counter(
            "pagedjax_request_errors", "Requests the engine finished with an error.", registry=reg
        )
        self.step_failures = Counter(
            "pagedjax_step_failures",
            "Engine steps that raised (every request in flight failed).",
            registry=reg,
        )
        self.requests_finished = Counter(
            "pagedjax_request_success",
            "Finished sequences by finish reason.",
            ["finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "pagedjax_time_to_first_token_seconds",
            "Time to first token.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "pagedjax_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=reg,
        )
        self.lora_requests = Counter(
            "pagedjax_lora_requests",
            "Requests admitted, by LoRA adapter.",
            ["lora_name"],
            registry=reg,
        )
        self.lora_tokens = Counter(
            "pagedjax_lora_generation_tokens",
            "Tokens generated, by LoRA adapter.",
            ["lora_name"],
            registry=reg,
        )
        self.max_loras = 0  # set by the server when LoRA is on
        self._lock = threading.Lock()
        self._engine_stats: EngineStats | None = None
        self._lora_info: tuple[list[str], list[str]] | None = None
        # () -> (programs compiled, seconds), read at scrape time; None: the snapshot's
        self.compile_counts: Callable[[], tuple[int, float]] | None = None
        reg.register(_EngineCollector(self))

    @property
    def engine_stats(self) -> EngineStats | None:
        with self._lock:
            return self._engine_stats

    def publish(self, stats: EngineStats) -> None:
        """Called by the engine thread with a fresh ``engine.get_stats()``. Tokens generated
        are the engine's count, step by step, whatever each request asked to be returned when
        (those before the first publish, the start's warm-up, are not the server's)."""
        count, base = stats.num_generation_tokens, self._generation_base
        if base is not None and count > base:
            self.generation_tokens.inc(count - base)
            self.vllm.inc("generation_tokens", count - base)
        self._generation_base = count  # lower after a loaded engine state: counted from there
        with self._lock:
            self._engine_stats = stats

    @property
    def lora_info(self) -> tuple[list[str], list[str]] | None:
        with self._lock:
            return self._lora_info

    def publish_lora(self, info: tuple[list[str], list[str]]) -> None:
        """Called by the engine thread: the running and the waiting requests' adapters."""
        with self._lock:
            self._lora_info = info

    def lora_request(self, lora_name: str | None) -> None:
        if lora_name is not None:
            self.lora_requests.labels(lora_name=lora_name).inc()

    def lora_generation_tokens(self, lora_name: str | None, count: int) -> None:
        if lora_name is not None and count:
            self.lora_tokens.labels(lora_name=lora_name).inc(count)

    @property
    def model_name(self) -> str:
        """The ``model_name`` label of the vllm: series (the first served name)."""
        return self.vllm.model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.vllm.set_model_name(name)

    def admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.vllm.inc("prompt_tokens", num_prompt_tokens)

    def finished(self, reason: str, count: int = 1) -> None:
        self.requests_finished.labels(finished_reason=reason).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
