"""`pagedjax bench serve`'s flags, and their checks before any server starts or request is sent."""

from __future__ import annotations

import argparse
import json
import math
import os

from pagedjax.bench import vllm_result
from pagedjax.bench.serve_client import ENDPOINTS
from pagedjax.bench.serve_peers import KNOWN_PEERS
from pagedjax.bench.serve_workload import DATASETS

# vLLM's --backend: the API it speaks -> its default endpoint
BACKENDS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}

DESCRIPTION = (
    "Online serving benchmark over HTTP, like `vllm bench serve`: any OpenAI-compatible server."
)


def extra_body(args) -> dict:
    """--extra-body as a dict ({} when absent); ValueError naming the flag when it is not one."""
    if not args.extra_body:
        return {}
    try:
        body = json.loads(args.extra_body)
    except ValueError as e:
        raise ValueError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return body


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="pagedjax bench serve")
    p.description = DESCRIPTION
    p.add_argument(
        "--base-url", default=None, help="the server to measure (default: http://HOST:PORT)"
    )
    p.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    p.add_argument("--port", type=int, default=8000, help="the server's port, without --base-url")
    p.add_argument(
        "--backend",
        default=None,
        choices=list(BACKENDS),
        help="the API the server speaks (vLLM's): openai / vllm (completions), openai-chat "
        "(default: the --endpoint's, else openai)",
    )
    p.add_argument(
        "--endpoint",
        default=None,
        choices=ENDPOINTS,
        help="the API path (default: the backend's, /v1/completions or /v1/chat/completions)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="request model name (default: the server's "
        "first); with --compare, the weights to serve (default: embedded SmolLM2)",
    )
    p.add_argument("--tokenizer", default=None, help="directory, hub id or .gguf (default: model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--server-name", default="server", help="the name in tables (single server)")
    _add_workload_args(p)
    _add_traffic_args(p)
    _add_report_args(p)
    _add_started_server_args(p)
    return p


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """What is sent: the dataset, its sizes and its seed."""
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default="sharegpt-like", choices=[*DATASETS, "sharegpt"])
    w.add_argument(
        "--dataset-path",
        default=None,
        help="JSON requests (--dataset-name json), or vLLM's ShareGPT JSON (sharegpt)",
    )
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument(
        "--input-len", type=int, default=None, help="vLLM's: the random dataset's prompt length"
    )
    w.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="vLLM's: every request's output length (random: --random-output-len)",
    )
    w.add_argument("--random-input-len", type=int, default=128)
    w.add_argument("--random-output-len", type=int, default=64)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--max-prompt-len", type=int, default=256, help="sharegpt-like and json")
    w.add_argument("--max-output-len", type=int, default=128, help="sharegpt-like and json")
    w.add_argument("--seed", type=int, default=0)


def _add_traffic_args(p: argparse.ArgumentParser) -> None:
    """When requests are sent: rate, concurrency, sweeps and repeats."""
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=math.inf, help="req/s (default inf)")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    t.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    t.add_argument("--sweep-rates", default=None, help="e.g. 1,2,4: one run per request rate")
    t.add_argument("--sweep-concurrency", default=None, help="e.g. 1,4,16: one run per limit")
    t.add_argument(
        "--sweep-num-prompts",
        default=None,
        help="e.g. 8,32,64: prompts per sweep value (the workload's first; default all)",
    )
    t.add_argument(
        "--sweep-num-warmups",
        default=None,
        help="e.g. 1,16,64: warm-up requests per sweep value, sent at its concurrency before its "
        "timed runs (prompts of a seed no timed run uses); default: --num-warmups before the "
        "first value only, one at a time",
    )
    t.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per row, each on a workload of its own seed (--seed, --seed+1, ...): "
        "the row is the run of median output tok/s, with min/median/max over the runs",
    )
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    t.add_argument("--num-warmups", type=int, default=2, help="excluded, reported apart")
    t.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait for its next byte",
    )


def _add_report_args(p: argparse.ArgumentParser) -> None:
    """What is reported, and when the command fails."""
    r = p.add_argument_group("report")
    r.add_argument("--slo", default=None, help="goodput SLO in ms, e.g. ttft=500,tpot=50,e2el=5000")
    r.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="vLLM's SLO: ttft:500 tpot:50"
    )
    r.add_argument("--json", action="store_true", help="print the results as JSON")
    r.add_argument(
        "--save-result",
        action="store_true",
        help="write vLLM's result JSON (one file per run: --result-dir, --result-filename)",
    )
    r.add_argument("--append-result", action="store_true", help="append it to the file instead")
    r.add_argument(
        "--save-detailed",
        action="store_true",
        help="vLLM's: keep the per-request lists (ttfts, itls, ...); they are always kept here",
    )
    r.add_argument("--result-dir", default=None, help="where the result files go")
    r.add_argument(
        "--result-filename",
        default=None,
        help="the result file's name (default: vLLM's {label}-{rate}qps-{model}-{date}.json)",
    )
    r.add_argument("--label", default=None, help="the result's label (default: --backend)")
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    r.add_argument(
        "--percentile-metrics",
        default=None,
        help="metrics with percentiles in the result: ttft,tpot,itl,e2el (default ttft,tpot,itl)",
    )
    r.add_argument(
        "--metric-percentiles", default="99", help="their percentiles, e.g. 50,90,99 (default 99)"
    )
    r.add_argument(
        "--ignore-eos",
        action="store_true",
        help="vLLM's: requests ignore EOS (always here, where the server takes it: exact lengths)",
    )
    r.add_argument("--plot", default="bench_serve_sweep.png", help="the sweep's PNG")
    r.add_argument("--disable-tqdm", action="store_true")
    r.add_argument(
        "--max-failure-rate",
        type=float,
        default=0.0,
        help="the fraction of a server's timed requests that may fail before the command exits "
        "1 (default 0: any failure)",
    )


def _add_started_server_args(p: argparse.ArgumentParser) -> None:
    """The servers the command starts itself (--compare, --start-pagedjax)."""
    c = p.add_argument_group("started servers (--compare)")
    c.add_argument("--compare", default=None, help=f"peers to start: {','.join(KNOWN_PEERS)}")
    c.add_argument("--peer", action="append", help="NAME=COMMAND with {port} ({host}, {model})")
    c.add_argument("--no-pagedjax", action="store_true", help="start only the peers")
    c.add_argument(
        "--start-pagedjax",
        action="store_true",
        help="start pagedjax serve with these settings and measure it (alone, without --compare)",
    )
    c.add_argument("--server-args", action="append", help="NAME=ARGS: extra flags for NAME")
    c.add_argument(
        "--disable-eos-copy",
        metavar="DIR",
        default=None,
        help="write a copy of --model without EOS into DIR (reused if there); with "
        "--compare every server serves it",
    )
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--max-model-len", type=int, default=None)
    c.add_argument("--server-timeout", type=float, default=600.0, help="seconds to get healthy")
    c.add_argument("--log-dir", default=None, help="server logs (default: a new temp dir)")


def resolve_vllm_args(args) -> None:
    """vLLM's flags in terms of ours: --host/--port as --base-url, --backend's endpoint,
    --input-len / --output-len as the random lengths, --goodput as the SLO."""
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    if args.backend is None:
        args.backend = "openai-chat" if args.endpoint == "/v1/chat/completions" else "openai"
    default = BACKENDS[args.backend]
    if args.endpoint is None:
        args.endpoint = default
    elif (args.endpoint == "/v1/chat/completions") != (default == "/v1/chat/completions"):
        raise ValueError(f"--endpoint {args.endpoint} is not the API of --backend {args.backend}")
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
    if args.goodput:
        if args.slo:
            raise ValueError("give --goodput (vLLM's) or --slo, not both")
        args.slo = ",".join(f"{k}={v}" for k, v in vllm_result.parse_goodput(args.goodput).items())
    vllm_result.parse_metrics(args.percentile_metrics)
    vllm_result.parse_percentiles(args.metric_percentiles)


def validate_args(args) -> None:
    resolve_vllm_args(args)
    for flag, value, low in (
        ("--num-prompts", args.num_prompts, 1),
        ("--num-warmups", args.num_warmups, 0),
        ("--repeats", args.repeats, 1),
        ("--random-input-len", args.random_input_len, 1),
        ("--random-output-len", args.random_output_len, 1),
        ("--max-prompt-len", args.max_prompt_len, 1),
        ("--max-output-len", args.max_output_len, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not 0 <= args.max_failure_rate <= 1:
        raise ValueError(f"--max-failure-rate must be in [0, 1], got {args.max_failure_rate}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    extra_body(args)  # a bad --extra-body fails before any server starts
