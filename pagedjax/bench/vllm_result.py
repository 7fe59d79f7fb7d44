"""``vllm bench``'s result files, written by ``pagedjax bench serve | latency | throughput`` so that
a script that reads vLLM's results reads ours.

- serve: one flat object per run (``serve_result``): the run's counts and throughputs,
  ``mean_/median_/std_/p<P>_<metric>_ms`` for the metrics and percentiles asked
  (``--percentile-metrics``, ``--metric-percentiles``), the per-request lists (``input_lens``,
  ``output_lens``, ``ttfts``, ``itls``, ``latencies``, ``start_times``, ``generated_texts``,
  ``errors``), the peak output tok/s and concurrency, and the run's settings (``date``,
  ``backend``, ``model_id``, ``request_rate``, ...); named as vLLM names it
  (``{label}-{rate}qps[-concurrency{C}]-{model}-{date}.json``, or ``--result-filename``, in
  ``--result-dir``).
- latency: ``avg_latency``, ``std_latency``, ``latencies``, ``percentiles`` (keys "10" ... "99"),
  seconds.
- throughput: ``elapsed_time``, ``num_requests``, ``total_num_tokens``, ``requests_per_second``,
  ``tokens_per_second``.

Every file may carry more keys (ours), never fewer.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path

import numpy as np

from pagedjax.bench.serve_metrics import jsonable

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def parse_metrics(text: str | None) -> list[str]:
    """--percentile-metrics: comma-separated names of PERCENTILE_METRICS."""
    names = [n.strip() for n in (text or DEFAULT_PERCENTILE_METRICS).split(",") if n.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(
            f"--percentile-metrics takes names of {', '.join(PERCENTILE_METRICS)}, got {text!r}"
        )
    return names


def parse_percentiles(text: str) -> list[float]:
    """--metric-percentiles: comma-separated numbers in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles takes numbers in (0, 100], got {text!r}")
    return values


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """--goodput KEY:MS ... (vLLM's): {"ttft": ms, ...}."""
    slo = {}
    for pair in pairs or []:
        key, sep, value = pair.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft/tpot/e2el:MS pairs, got {pair!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}: {value!r} is not a number of ms") from None
        if ms < 0:
            raise ValueError(f"--goodput {key} must be >= 0 ms, got {value}")
        slo[key] = ms
    return slo


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _tpot(r) -> float:
    n = r.output_tokens or 0
    return (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0


def _peaks(ok) -> tuple[float, int]:
    """(the most output tokens in one second, the most requests in flight at once)."""
    if not ok:
        return 0.0, 0
    start = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    per_second = np.zeros(int(math.ceil(end - start)) + 1)
    for r in ok:
        t = r.start_time + r.ttft
        per_second[int(t - start)] += 1
        for gap in r.itl:
            t += gap
            per_second[min(int(t - start), len(per_second) - 1)] += 1
    events = sorted(
        [(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok],
        key=lambda e: (e[0], e[1]),
    )
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return float(per_second.max()), peak


def serve_result(results, duration: float, slo: dict, metrics, percentiles) -> dict:
    """vLLM's flat result of one timed run (``results``: serve_client.RequestResult, in
    workload order; their output_tokens counted)."""
    ok = [r for r in results if r.success]
    out_lens = [(r.output_tokens or 0) if r.success else 0 for r in results]
    total_in = sum(r.prompt_len for r in ok)
    d = max(duration, 1e-9)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [_tpot(r) for r in ok if (r.output_tokens or 0) > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    good = None
    if slo:
        got = lambda r: {"ttft": r.ttft, "tpot": _tpot(r), "e2el": r.latency}  # noqa: E731
        good = sum(all(got(r)[k] * 1e3 <= ms for k, ms in slo.items()) for r in ok) / d
    peak_tokens, peak_requests = _peaks(ok)
    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": sum(out_lens),
        "request_throughput": len(ok) / d,
        "request_goodput": good,
        "output_throughput": sum(out_lens) / d,
        "total_token_throughput": (total_in + sum(out_lens)) / d,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": out_lens,
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [list(r.itl) if r.success else [] for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    for name in metrics:
        ms = np.asarray(values[name] or [0.0], dtype=float) * 1e3
        result[f"mean_{name}_ms"] = float(ms.mean())
        result[f"median_{name}_ms"] = float(np.median(ms))
        result[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            result[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return result


def serve_header(args, model_id: str, tokenizer_id: str, rate: float, concurrency) -> dict:
    """The settings vLLM writes before a run's figures."""
    header = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, got {item!r}")
        header[key.strip()] = value.strip()
    header["request_rate"] = rate if rate < float("inf") else "inf"
    header["burstiness"] = args.burstiness
    header["max_concurrency"] = concurrency
    return header


def serve_file_name(args, model_id: str, header: dict, suffix: str = "") -> str:
    """vLLM's file name for a result (``suffix``: which of several runs)."""
    base_model = model_id.split("/")[-1]
    concurrency = f"-concurrency{header['max_concurrency']}" if header["max_concurrency"] else ""
    label = args.label or args.backend
    name = f"{label}-{header['request_rate']}qps{concurrency}-{base_model}-{header['date']}.json"
    if args.result_filename:
        name = args.result_filename
    if suffix:
        stem, ext = os.path.splitext(name)
        name = f"{stem}-{suffix}{ext or '.json'}"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def save_serve_results(result: dict, args) -> list[str]:
    """Write each timed row of a ``bench serve`` result as vLLM's result file (several rows: a
    sweep or servers side by side, each file named for its row); the paths written."""
    rows = [(s, row) for s in result["servers"] for row in s["rows"]]
    paths = []
    for server, row in rows:
        header = serve_header(
            args,
            server["model"],
            args.tokenizer or server["model"],
            row["request_rate"],
            row["max_concurrency"],
        )
        suffix = ""
        if len(rows) > 1:
            knob = result.get("knob")
            suffix = server["server"] + (f"-{knob}{row[knob]}" if knob else "")
        path = serve_file_name(args, server["model"], header, suffix)
        extra = {"server": server["server"], "exact_lengths": row["exact_lengths"]}
        write(path, {**header, **row["vllm"], **extra}, append=args.append_result)
        paths.append(path)
    return paths


def write(path: str, result: dict, append: bool = False) -> None:
    """Write (or, as vLLM's --append-result, append a line of) one result."""
    with open(path, "a+" if append else "w", encoding="utf-8") as f:
        if append and f.tell() != 0:
            f.write("\n")
        json.dump(jsonable(result), f)


def latency_result(latencies_s: list[float]) -> dict:
    """vLLM's ``bench latency`` result of the timed iterations (seconds)."""
    lat = np.asarray(latencies_s, dtype=float)
    values = np.percentile(lat, LATENCY_PERCENTILES)
    return {
        "avg_latency": float(lat.mean()),
        "std_latency": float(lat.std()),
        "latencies": lat.tolist(),
        "percentiles": {str(p): float(v) for p, v in zip(LATENCY_PERCENTILES, values, strict=True)},
    }


def throughput_result(elapsed_s: float, num_requests: int, total_num_tokens: int) -> dict:
    """vLLM's ``bench throughput`` result."""
    return {
        "elapsed_time": elapsed_s,
        "num_requests": num_requests,
        "total_num_tokens": total_num_tokens,
        "requests_per_second": num_requests / elapsed_s,
        "tokens_per_second": total_num_tokens / elapsed_s,
    }


def write_json(path: str | Path, result: dict) -> None:
    """--output-json (latency, throughput): indented, as vLLM writes it."""
    Path(path).write_text(json.dumps(jsonable(result), indent=4) + "\n")
