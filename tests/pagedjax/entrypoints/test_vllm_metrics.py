# ruff: noqa: E501  (vLLM's dashboard queries, verbatim)
"""/metrics under vLLM's names: every series vLLM's published Grafana dashboard queries
(examples/observability/prometheus_grafana/grafana.json, its PromQL kept here as data) exists
with the labels the queries select and group by, and the counts and histograms agree with the
requests that ran (a tiny byte-level model: one token per byte, so lengths are exact)."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import KEY, live_server, make_byte_model, raw, sse_events

from pagedjax import LLM
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.entrypoints.openai.app_options import AppOptions
from pagedjax.metrics.vllm_series import VLLM_METRIC_NAMES, one_two_five

MODEL = "tiny-bytes"

# Every "expr" of vLLM's dashboard (vllm-project/vllm,
# examples/observability/prometheus_grafana/grafana.json), panel by panel.
DASHBOARD_QUERIES = (
    # E2E Request Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    # Token Throughput
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    # Inter Token Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    # Scheduler State
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    # Time To First Token Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    # Cache Utilization
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    # Request Prompt Length, Request Generation Length (heatmaps)
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    # Finish Reason
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    # Queue Time
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    # Requests Prefill and Decode Time
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    # Max Generation Token in Sequence Group
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
)
# The dashboard's template variable: label_values(model_name)
TEMPLATE_LABEL = "model_name"

_SELECTOR = re.compile(r"(vllm:[a-zA-Z0-9_:]+)(?:\{([^}]*)\})?")
_BY = re.compile(r"by\s*\(([^)]*)\)")


def selectors(expr: str) -> list[tuple[str, set[str], set[str]]]:
    """(series name, labels it matches on, labels the query groups it by) per selector."""
    grouped = {x.strip() for m in _BY.finditer(expr) for x in m.group(1).split(",")}
    out = []
    for m in _SELECTOR.finditer(expr):
        matched = {part.split("=")[0].strip() for part in (m.group(2) or "").split(",") if part}
        out.append((m.group(1), matched, grouped))
    return out


def scrape(base) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)] of the server's /metrics."""
    status, body = raw(base, "GET", "/metrics")
    assert status == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def only(samples, name, **labels) -> float:
    found = [v for ls, v in samples.get(name, []) if all(ls.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("metrics_bytes")
    make_byte_model(path)
    llm = LLM(str(path), block_size=8, num_blocks=200, max_model_len=96, seed=0)
    app = build_app(EngineLoop(llm.engine), [MODEL, "alias"], AppOptions(api_key=KEY))
    with live_server(app) as base:
        prompts = ["Hello there", "abc", "a longer prompt here"]
        for p in prompts:
            body = {"model": MODEL, "prompt": p, "max_tokens": 5, "ignore_eos": True}
            status, _ = raw(base, "POST", "/v1/completions", body)
            assert status == 200
        chat = {
            "model": "alias",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "n": 2,
        }
        status, body = raw(base, "POST", "/v1/chat/completions", chat)
        assert status == 200 and sse_events(body)[-1] == "[DONE]"
        yield base, [len(p) for p in prompts], scrape(base)


def test_every_series_of_vllms_dashboard_exists_with_the_labels_it_queries(served):
    base, _, samples = served
    checked = set()
    for expr in DASHBOARD_QUERIES:
        for name, matched, grouped in selectors(expr):
            assert name in samples, f"{name} (queried by {expr!r}) is not exported"
            labelled = [ls for ls, _ in samples[name] if ls.get(TEMPLATE_LABEL) == MODEL]
            assert labelled, f"{name} has no series labelled {TEMPLATE_LABEL}={MODEL!r}"
            for label in (matched | grouped) - {TEMPLATE_LABEL}:
                assert all(label in ls for ls in labelled), f"{name} lacks the label {label!r}"
            checked.add(name)
    # the dashboard's 27 queries read 21 series (16 metrics: a histogram's _bucket, _sum, _count)
    assert len(DASHBOARD_QUERIES) == 27 and len(checked) == 21
    # the names the dashboard needs are among those the server declares it exports
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in checked}
    assert bases <= set(VLLM_METRIC_NAMES)


def test_the_counts_agree_with_the_requests_that_ran(served):
    _, prompt_lens, s = served
    labels = {"model_name": MODEL, "engine": "0"}
    # three completions of 5 tokens, one chat request with two choices of 4
    assert only(s, "vllm:request_success_total", finished_reason="length", **labels) == 5
    assert only(s, "vllm:request_success_total", finished_reason="stop", **labels) == 0
    assert only(s, "vllm:generation_tokens_total", **labels) == 3 * 5 + 2 * 4
    chat_prompt = only(s, "vllm:request_prompt_tokens_sum", **labels) - sum(prompt_lens)
    assert chat_prompt > 0
    assert only(s, "vllm:prompt_tokens_total", **labels) == sum(prompt_lens) + chat_prompt
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_params_n",
    ):
        assert only(s, name + "_count", **labels) == 4, name
        assert only(s, name + "_bucket", le="+Inf", **labels) == 4, name
    assert only(s, "vllm:request_generation_tokens_sum", **labels) == 3 * 5 + 2 * 4
    assert only(s, "vllm:request_max_num_generation_tokens_sum", **labels) == 3 * 5 + 4
    assert only(s, "vllm:request_params_n_sum", **labels) == 3 + 2
    assert only(s, "vllm:request_params_max_tokens_sum", **labels) == 3 * 5 + 4
    # one gap per request and step after its first tokens: 4 per completion, 3 for the chat
    assert only(s, "vllm:inter_token_latency_seconds_count", **labels) == 3 * 4 + 3
    assert only(s, "vllm:time_per_output_token_seconds_count", **labels) == 3 * 4 + 3
    # token-count buckets as vLLM's: 1, 2, 5, ... up to max_model_len
    les = [ls["le"] for ls, _ in s["vllm:request_prompt_tokens_bucket"]]
    assert les == [str(float(b)) for b in one_two_five(96)] + ["+Inf"]
    assert only(s, "vllm:num_requests_running", **labels) == 0
    assert only(s, "vllm:kv_cache_usage_perc", **labels) == 0.0
    assert only(s, "vllm:num_preemptions_total", **labels) == 0
    queries = only(s, "vllm:prefix_cache_queries_total", **labels)
    assert queries % 8 == 0 and queries >= only(s, "vllm:prefix_cache_hits_total", **labels)
    (info,) = s["vllm:cache_config_info"]
    assert info[0]["block_size"] == "8" and info[0]["num_gpu_blocks"] == "199"
    # the pagedjax_ names stay beside them
    assert s["pagedjax_generation_tokens_total"][0][1] == 3 * 5 + 2 * 4


def test_the_dashboard_query_parser_sees_names_labels_and_groupings():
    (only_one,) = selectors('sum by(finished_reason) (increase(vllm:x_total{model_name="m"}[1m]))')
    assert only_one == ("vllm:x_total", {"model_name"}, {"finished_reason"})
    assert selectors("vllm:y + vllm:z2_total") == [
        ("vllm:y", set(), set()),
        ("vllm:z2_total", set(), set()),
    ]


def test_the_server_and_llm_get_metrics_read_one_list_of_names():
    from pagedjax.metrics import names
    from pagedjax.metrics.offline import RequestCounts, engine_metrics
    from pagedjax.outputs import EngineStats

    stats = EngineStats(10, 2, 3, 0, 0, 0.0, 1, 0, 0.0, 0, prefix_cache_queries=4)
    labels = {"model_name": MODEL, "engine": "0"}
    offline = engine_metrics(stats, labels, block_size=8) + RequestCounts(96).metrics(labels)
    assert {m.name for m in offline} <= set(names.ALL) == set(VLLM_METRIC_NAMES)
    queries = next(m for m in offline if m.name == "vllm:prefix_cache_queries")
    assert queries.value == 4 * 8  # tokens, as vLLM and the server count them
    histogram = next(m for m in offline if m.name == "vllm:request_prompt_tokens")
    assert list(histogram.buckets) == [
        str(b) for b in names.buckets("request_prompt_tokens", 96)
    ] + ["+Inf"]
