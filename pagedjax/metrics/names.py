"""vLLM's metric names (``vllm:...``), their help texts and buckets: the one list that the
server's /metrics (vllm_series.py) and ``LLM.get_metrics()`` (offline.py)
both read. Names are given without the ``vllm:`` prefix (``full`` adds it)."""

from __future__ import annotations

LABELS = ("model_name", "engine")

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
LATENCY_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets of token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# name (without vLLM's "vllm:" prefix), help, buckets ("tokens": one_two_five(max_model_len))
HISTOGRAMS = (
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    (
        "time_per_output_token_seconds",
        "Histogram of time per output token in seconds (deprecated: inter_token_latency).",
        ITL_BUCKETS,
    ),
    (
        "request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        ITL_BUCKETS,
    ),
    (
        "e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        LATENCY_BUCKETS,
    ),
    (
        "request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        LATENCY_BUCKETS,
    ),
    (
        "request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        LATENCY_BUCKETS,
    ),
    (
        "request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        LATENCY_BUCKETS,
    ),
    (
        "request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        LATENCY_BUCKETS,
    ),
    ("request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    (
        "request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        "tokens",
    ),
    ("request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
    ("request_params_max_tokens", "Histogram of the max_tokens request parameter.", "tokens"),
)
# name, help: counters updated per request (the engine's counters are in ENGINE_COUNTERS)
COUNTERS = (
    ("prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "Number of generation tokens processed."),
)
GAUGES = (
    ("num_requests_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
)
ENGINE_COUNTERS = (
    ("num_preemptions", "Cumulative number of preemption from the engine."),
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
)
SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)
FINISHED_REASONS = ("stop", "length", "abort")

# Every vllm: metric name this server exports (a counter's samples add "_total", a histogram's
# "_bucket", "_sum" and "_count")
ALL = tuple(
    "vllm:" + name
    for name in (
        *(n for n, _, _ in HISTOGRAMS),
        *(n for n, _ in COUNTERS),
        "request_success",
        *(n for n, _ in GAUGES),
        *(n for n, _ in ENGINE_COUNTERS),
        *(n for n, _ in SPEC_COUNTERS),
        "spec_decode_num_accepted_tokens_per_pos",
        "cache_config_info",
        "lora_requests_info",
    )
)


def full(name: str) -> str:
    """The exported name: ``vllm:`` + ``name``."""
    return "vllm:" + name


def buckets(name: str, max_model_len: int) -> tuple:
    """The buckets of the histogram ``name`` (token counts: 1, 2, 5, ... up to
    ``max_model_len``)."""
    for n, _, b in HISTOGRAMS:
        if n == name:
            return one_two_five(max_model_len) if b == "tokens" else b
    raise KeyError(f"no vLLM histogram named {name!r}")
