"""Figures of ``pagedjax bench serve`` from per-request results: throughput, latency percentiles,
goodput under an SLO, errors by message; and their tables (one run, servers side by side, a
sweep) and the sweep's plot. Plain Python + numpy; matplotlib only when a plot is asked for."""

from __future__ import annotations

import collections
import json
import math
import os

import numpy as np

from pagedjax.bench.serve_client import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_NAMES = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "itl": "inter-token latency",
    "e2el": "end-to-end latency",
}
STATS = ("mean", "median", "p90", "p99")
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500,tpot=50`` (ms; ``:`` works too) -> {"ttft": 500.0, "tpot": 50.0}."""
    if not text:
        return {}
    slo = {}
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        key, sep, value = part.replace(":", "=").partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo takes {'/'.join(SLO_KEYS)}=MS pairs, got {part!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo {key}: {value!r} is not a number of ms") from None
        if not ms > 0:
            raise ValueError(f"--slo {key} must be > 0 ms, got {value}")
        slo[key] = ms
    return slo


def _stats(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return dict.fromkeys(STATS)
    ms = np.asarray(values_s, dtype=float) * 1e3
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def tpot(r: RequestResult) -> float | None:
    """(end-to-end - TTFT) / (output tokens - 1), as vLLM defines it; None for one token."""
    if not r.success or not r.output_tokens or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return all(got[k] * 1e3 <= ms for k, ms in slo.items())


def summarize(results: list[RequestResult], duration_s: float, slo: dict[str, float]) -> dict:
    """The figures of one timed run (warm-ups excluded by the caller)."""
    ok = [r for r in results if r.success]
    errors = collections.Counter(r.error for r in results if not r.success)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    d = max(duration_s, 1e-9)
    row = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common()),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "requested_output_tokens": sum(r.output_len for r in ok),
        "exact_lengths": sum(r.output_tokens == r.output_len for r in ok),
        "request_throughput": len(ok) / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft": _stats([r.ttft for r in ok]),
        "tpot": _stats([t for r in ok if (t := tpot(r)) is not None]),
        "itl": _stats([x for r in ok for x in r.itl]),
        "e2el": _stats([r.latency for r in ok]),
    }
    if slo:
        good = sum(_meets(r, slo) for r in ok)
        row["slo_ms"] = dict(slo)
        row["good_requests"] = good
        row["goodput"] = good / d
    return row


def pick_median_run(runs: list[dict]) -> dict:
    """One row for several timed runs of the same settings: the run of median output tok/s
    (the lower of the middle two for an even count), with ``repeats``: every run's output tok/s
    and their min, median and max."""
    if not runs:
        raise ValueError("pick_median_run needs at least one run")
    tps = [r["output_throughput"] for r in runs]
    order = sorted(range(len(runs)), key=lambda i: tps[i])
    row = dict(runs[order[(len(runs) - 1) // 2]])
    row["repeats"] = {
        "runs": len(runs),
        "output_throughput": tps,
        "min": min(tps),
        "median": float(np.median(tps)),
        "max": max(tps),
    }
    return row


def warmup_summary(results: list[RequestResult]) -> dict:
    """The warm-up requests, reported apart: the first one pays for any lazy start."""
    return {
        "num": len(results),
        "failed": sum(not r.success for r in results),
        "errors": dict(collections.Counter(r.error for r in results if not r.success)),
        "ttft_ms": [None if r.ttft is None else r.ttft * 1e3 for r in results],
        "e2el_ms": [r.latency * 1e3 if r.success else None for r in results],
    }


# ---- tables ---------------------------------------------------------------------------------


def _fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, int | str):
        return str(x)
    return f"{x:.{digits}f}"


def _rows(row: dict) -> list[tuple[str, object]]:
    """(label, value) lines of one result, the order of every table."""
    lines = [
        ("successful requests", row["completed"]),
        ("failed requests", row["failed"]),
        ("exact output lengths", f"{row['exact_lengths']}/{row['completed']}"),
        ("duration (s)", row["duration_s"]),
        ("total input tokens", row["total_input_tokens"]),
        ("total output tokens", row["total_output_tokens"]),
        ("request throughput (req/s)", row["request_throughput"]),
        ("output throughput (tok/s)", row["output_throughput"]),
        ("total throughput (tok/s)", row["total_token_throughput"]),
    ]
    rep = row.get("repeats")
    if rep and rep["runs"] > 1:
        lines.append((f"output tok/s min of {rep['runs']} runs", rep["min"]))
        lines.append((f"output tok/s median of {rep['runs']} runs", rep["median"]))
    if "goodput" in row:
        lines.append(("goodput (req/s)", row["goodput"]))
        lines.append(("requests within the SLO", f"{row['good_requests']}/{row['completed']}"))
    for key in LATENCIES:
        for stat in STATS:
            lines.append((f"{stat} {key.upper()} (ms)", row[key][stat]))
    return lines


def print_single(row: dict, title: str = "Serving benchmark") -> None:
    width = 56
    print(f"{' ' + title + ' ':=^{width}}")
    for label, value in _rows(row):
        print(f"{label:<40}{_fmt(value):>16}")
    if row.get("slo_ms"):
        print(f"{'SLO (ms)':<40}{_slo_text(row['slo_ms']):>16}")
    print_errors(row)
    print("=" * width)


def _slo_text(slo: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in slo.items())


def print_errors(row: dict, name: str = "") -> None:
    for message, count in row["errors"].items():
        print(f"  {name + ': ' if name else ''}{count} x {message}")


def print_side_by_side(named: list[tuple[str, dict]]) -> None:
    """Servers as columns; a ratio column per peer (first server / peer, so > 1 means the first
    is better for throughput and worse for latency)."""
    names = [n for n, _ in named]
    ratio_cols = [f"{names[0]}/{n}" for n in names[1:]]
    cols = names + ratio_cols
    w = max(14, *(len(c) + 2 for c in cols))
    print(f"{'':<34}" + "".join(f"{c:>{w}}" for c in cols))
    lines = [_rows(r) for _, r in named]
    for i, (label, value0) in enumerate(lines[0]):
        values = [ls[i][1] for ls in lines]
        cells = [_fmt(v) for v in values]
        for v in values[1:]:
            num = isinstance(value0, int | float) and isinstance(v, int | float)
            cells.append(f"{value0 / v:.2f}x" if num and v and value0 is not None else "")
        print(f"{label:<34}" + "".join(f"{c:>{w}}" for c in cells))
    for name, row in named:
        print_errors(row, name)


SWEEP_COLS = (
    ("req/s", "request_throughput"),
    ("out tok/s", "output_throughput"),
    ("TTFT p50", ("ttft", "median")),
    ("TTFT p99", ("ttft", "p99")),
    ("TPOT p50", ("tpot", "median")),
    ("ITL p50", ("itl", "median")),
    ("E2E p50", ("e2el", "median")),
    ("goodput", "goodput"),
)


def _get(row: dict, key):
    if isinstance(key, tuple):
        return row[key[0]][key[1]]
    return row.get(key)


def print_sweep(rows: list[dict], knob: str) -> None:
    """One line per (server, rate or concurrency); latencies in ms."""
    cols = [(h, k) for h, k in SWEEP_COLS if k != "goodput" or any("goodput" in r for r in rows)]
    if any(r.get("repeats", {}).get("runs", 1) > 1 for r in rows):  # the spread of the runs
        cols[2:2] = [("tok/s min", ("repeats", "min")), ("tok/s med", ("repeats", "median"))]
    head = f"{'server':<14}{knob:>16}{'ok':>6}{'fail':>6}{'exact':>7}"
    print(head + "".join(f"{h:>11}" for h, _ in cols) + "   (latencies in ms)")
    for r in rows:
        print(
            f"{r['server']:<14}{_fmt(r[knob], 1):>16}{r['completed']:>6}{r['failed']:>6}"
            f"{r['exact_lengths']:>7}" + "".join(f"{_fmt(_get(r, k)):>11}" for _, k in cols)
        )
    for r in rows:
        print_errors(r, f"{r['server']} {knob}={r[knob]}")


def plot_sweep(rows: list[dict], knob: str, path: str) -> str | None:
    """Output throughput against median TTFT and TPOT, one line per server; the path written,
    or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (key, label) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT")), strict=True):
        for server in dict.fromkeys(r["server"] for r in rows):
            pts = [r for r in rows if r["server"] == server and r[key]["median"] is not None]
            xs = [r["output_throughput"] for r in pts]
            ys = [r[key]["median"] for r in pts]
            ax.plot(xs, ys, marker="o", label=server)
            for r, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"{r[knob]:g}", (x, y), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"median {label} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"throughput vs latency, points labelled by {knob}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def jsonable(x):
    """``x`` with non-finite floats as strings (JSON has no inf or NaN), dicts and sequences
    walked."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def report(result: dict, knob: str | None, args) -> None:
    """Print the JSON (--json) or the tables; the load average last, as a warning on the
    figures when the machine was busy. (--save-result writes vLLM's files: vllm_result.py.)"""
    rows = [row for s in result["servers"] for row in s["rows"]]
    plotted = plot_sweep(rows, knob, args.plot) if knob and rows else None
    if args.json:
        print(json.dumps(jsonable({**result, "rows": rows, "plot": plotted}), indent=2))
        return
    for s in result["servers"]:
        if "start_error" in s:
            print(f"{s['server']}: did not start; see {s['log']}")
            continue
        w = s["warmup"]
        sent = ", ".join(s["fields_sent"]) or "none"
        ready = f", ready in {s['ready_s']:.1f} s" if "ready_s" in s else ""
        print(f"{s['server']} ({s['base_url']}, model {s['model']}{ready}): extra fields: {sent}")
        if w["num"]:
            ttft = ", ".join(_fmt(t, 1) for t in w["ttft_ms"])
            e2el = ", ".join(_fmt(t, 1) for t in w["e2el_ms"])
            print(f"  warm-up (excluded): {w['num']} requests, TTFT ms [{ttft}], E2E ms [{e2el}]")
    if knob:
        print_sweep(rows, knob)
    elif len(rows) > 1:
        print_side_by_side([(r["server"], r) for r in rows])
    elif rows:
        print_single(rows[0])
    if knob and rows:
        print(f"plot: {plotted}" if plotted else "plot: skipped (matplotlib is not installed)")
    load = os.getloadavg()
    print(f"load average now: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    if load[1] > (os.cpu_count() or 1):
        print("the machine was busy: timings taken under this load are not trustworthy")
