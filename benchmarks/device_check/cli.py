"""The command line: which stages, which sizes; the log, the summary table, the exit status."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import jax

from . import sizes as sizes_module
from .bootstrap import ROOT
from .common import Context, say
from .running import run_stage
from .stages import STAGES


def parse_args(argv=None):
    doc = sys.modules[__package__].__doc__
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("device_check_out"), help="JSON + log here")
    p.add_argument("--toy", action="store_true", help="toy sizes, Pallas kernels interpreted (CPU)")
    p.add_argument(
        "--stages",
        default=",".join(n for n, _, _ in STAGES.values()),
        help="comma-separated stage numbers or names to run (default: all)",
    )
    p.add_argument("--big-layers", type=int, help="layers of the 8B-shaped model (of 32)")
    p.add_argument("--num-requests", type=int, help="requests in the stage-3b/5 workload")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage budget")
    args = p.parse_args(argv)
    wanted = {s.strip() for s in args.stages.split(",") if s.strip()}
    picks = {w: [k for k, (n, _, _) in STAGES.items() if w in (k, n, n[0])] for w in wanted}
    unknown = sorted(w for w, keys in picks.items() if not keys)
    if unknown:
        numbers = [n for n, _, _ in STAGES.values()]
        p.error(f"unknown stages {unknown}; choose numbers {numbers} or names {list(STAGES)}")
    args.stage_keys = [k for k in STAGES if any(k in keys for keys in picks.values())]
    return args


class Tee:
    """Write to the console and the log file, flushing both."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # encoding, fileno, ...: the console's
        return getattr(self.streams[0], name)


def summary_table(ctx: Context) -> str:
    lines = ["| # | stage | status | s | result |", "|---|---|---|---|---|"]
    for key, r in ctx.results.items():
        n = STAGES[key][0]
        text = r.summary.replace("|", "/").replace("\n", " ")
        lines.append(f"| {n} | {key} | {r.status} | {r.seconds:.0f} | {text} |")
    return "\n".join(lines)


def main(argv=None) -> Context:
    args = parse_args(argv)
    sizes = sizes_module.TOY if args.toy else sizes_module.DEVICE
    if args.big_layers:
        sizes = dataclasses.replace(sizes, big_layers=args.big_layers)
    if args.num_requests:
        sizes = dataclasses.replace(sizes, num_requests=args.num_requests)
    sizes = dataclasses.replace(
        sizes, budgets={k: v * args.budget_scale for k, v in sizes.budgets.items()}
    )
    backend = jax.default_backend()
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(["python3 benchmarks/device_check", *argv])
    ctx = Context(sizes, backend, interpret=args.toy, out=args.out, command=command)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.out.resolve().is_relative_to(ROOT):  # results inside the checkout stay out of git
        (args.out / ".gitignore").write_text("*\n")
    with (
        open(args.out / "device_check.log", "w") as log,
        contextlib.redirect_stdout(Tee(sys.stdout, log)),
        contextlib.redirect_stderr(Tee(sys.stderr, log)),
    ):
        start = time.perf_counter()
        say(f"pagedjax device check: {ctx.command}  ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})")
        if backend not in ("gpu", "tpu") and not args.toy:
            say(f"no GPU or TPU here (JAX backend {backend!r}): use --toy for a CPU smoke run")
            raise SystemExit(2)
        for key in args.stage_keys:
            _, title, fn = STAGES[key]
            run_stage(ctx, key, title, fn, sizes.budgets[key])
        say(f"\n== summary ({time.perf_counter() - start:.0f} s; JSON and log in {args.out}) ==")
        say(summary_table(ctx))
    return ctx


def run(argv=None) -> int:
    """``main``, as an exit status: 0 when every stage passed or did not apply."""
    ctx = main(argv)
    return 0 if all(r.status in ("PASS", "SKIP") for r in ctx.results.values()) else 1
