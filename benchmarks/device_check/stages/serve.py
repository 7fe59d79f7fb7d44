"""Stage 6: online serving over HTTP, ``pagedjax bench serve`` against ``pagedjax serve`` and its
peers (``transformers serve``) on the same device, one server at a time."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..bootstrap import ROOT, SOURCE_TREE
from ..common import TOY_NOTE, Budget, BudgetSpent, Context, StageSkipped, fmt_f, ratio, say

WHEELHOUSE = ROOT / "wheelhouse"  # `make wheelhouse`; copied beside the checkout, never committed

SERVE_MODULES = (
    "fastapi",
    "starlette",
    "pydantic",
    "uvicorn",
    "prometheus_client",
    "httpx2",
    "orjson",
)

# The project's dependencies that the device image holds (its package list as read on 2026-11-17):
# every other one that serving imports must be in SERVE_MODULES, carried in the wheelhouse.
IN_IMAGE = (
    "jax",
    "jaxlib",
    "flax",
    "orbax",
    "transformers",
    "numpy",
    "safetensors",
    "tqdm",
    "huggingface_hub",
    "sentencepiece",
    "tokenizers",
    "prometheus_client",
    "jinja2",
)

PEER_MODULES = {"transformers": ("fastapi", "uvicorn", "pydantic", "openai")}  # its serve command

SERVER_MEM_FRACTION = "0.25"  # a server's JAX share of the GPU; this process holds 0.5


def missing_modules(names) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def install_wheelhouse(data: dict) -> Path | None:
    """pip-install the wheelhouse's wheels (no index, no dependencies) into a temporary directory
    put first on sys.path; that directory, or None when there are no wheels."""
    wheels = sorted(WHEELHOUSE.glob("*.whl"))
    if not wheels:
        return None
    target = Path(tempfile.mkdtemp(prefix="pagedjax-wheels-"))
    atexit.register(shutil.rmtree, target, True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--target", str(target), *map(str, wheels)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install {WHEELHOUSE}:\n{done.stderr[-2000:]}")
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    data["wheelhouse"] = [w.name for w in wheels]
    say(f"  installed {len(wheels)} wheels from {WHEELHOUSE} into {target}")
    return target


@contextlib.contextmanager
def server_environment(ctx: Context, wheels: Path | None):
    """What the started servers need in their environment: this checkout and the wheels on
    PYTHONPATH (PYTHONSAFEPATH: ``python -m pagedjax`` run from the checkout must not import
    its uninstalled pagedjax/ first), and on a GPU a JAX share of its memory that fits beside
    this process's."""
    paths = [str(p) for p in (SOURCE_TREE, wheels) if p is not None]
    env = {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).strip(":")}
    if SOURCE_TREE is not None:
        env["PYTHONSAFEPATH"] = "1"
    if ctx.platform == "gpu":
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = SERVER_MEM_FRACTION
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def serve_peers(ctx: Context, data: dict) -> list[str]:
    """The peers that can start here (a NAME=COMMAND entry is a --peer command); the others
    are recorded under ``peers_skipped`` with the reason."""
    from pagedjax.bench.serve_peers import _find_exe

    ready, skipped = [], {}
    for peer in ctx.sizes.serve.peers:
        if "=" in peer:
            ready.append(peer)
            continue
        lacking = missing_modules(PEER_MODULES.get(peer, ()))
        if _find_exe(peer) is None:
            skipped[peer] = f"no {peer!r} executable beside {sys.executable} or on PATH"
        elif lacking:
            needs = ", ".join(lacking)
            skipped[peer] = f"{peer} serve needs {needs} (make wheelhouse, then copy it here)"
        else:
            ready.append(peer)
    if skipped:
        data["peers_skipped"] = skipped
        for peer, why in skipped.items():
            say(f"  peer {peer} skipped: {why}")
    return ready


def serve_common_argv(ctx: Context, model_dir: Path, scratch: Path) -> list[str]:
    sv = ctx.sizes.serve
    pagedjax_flags = ["--max-num-seqs", str(sv.max_num_seqs), "--num-blocks", str(sv.num_blocks)]
    return [
        *("--model", str(model_dir), "--dtype", sv.dtype, "--max-model-len", str(sv.max_model_len)),
        # Already without EOS; the copy (hard links) tells bench serve so, as the CPU command does.
        *("--disable-eos-copy", str(scratch / "model-no-eos")),
        *("--server-args", "pagedjax=" + " ".join([*pagedjax_flags, *sv.pagedjax_args])),
        *("--dataset-name", "random", "--random-input-len", str(sv.input_len)),
        *("--random-output-len", str(sv.output_len), "--num-prompts", str(max(sv.num_prompts))),
        *("--sweep-concurrency", ",".join(map(str, sv.concurrency))),
        *("--sweep-num-prompts", ",".join(map(str, sv.num_prompts))),
        # Each row is warmed up by a wave at its own concurrency (vLLM's warm-up): the programs
        # of its batch sizes are compiled before it is timed (the start's own cost is stage 6's
        # ready time and the servers' logs).
        *("--sweep-num-warmups", ",".join(map(str, sv.concurrency))),
        *("--seed", "0", "--request-timeout", f"{sv.request_timeout_s:g}"),
        *("--disable-tqdm", "--log-dir", str(ctx.out / "serve_logs")),
        *("--plot", str(scratch / "sweep.png")),  # one server's; the stage draws both together
    ]


def run_bench_serve(argv: list[str]) -> dict:
    from pagedjax.bench import serve

    say(f"  $ pagedjax bench serve {shlex.join(argv)}")
    return serve.execute(serve.build_parser().parse_args(argv))


def serve_row_line(row: dict) -> str:
    return (
        f"  {row['server']:<14}{row['max_concurrency']:>6}{row['completed']:>6}{row['failed']:>6}"
        f"{row['exact_lengths']:>7}{row['output_throughput']:>11.1f}"
        f"{fmt_f(row['ttft']['median']):>11}{fmt_f(row['tpot']['median']):>11}"
        f"{fmt_f(row['e2el']['median']):>11}"
    )


def run(ctx: Context, budget: Budget, data: dict):
    if ctx.platform == "tpu":
        raise StageSkipped("the serving comparison runs its peers on a GPU (torch), not a TPU")
    wheels = serve_packages(data)
    peers = serve_peers(ctx, data)
    results = measure(ctx, budget, data, peers, wheels)
    servers = [srv for res in results for srv in res["servers"]]
    rows = [row for srv in servers for row in srv["rows"]]
    record(ctx, data, servers, rows)
    started = [srv for srv in servers if "start_error" not in srv]
    failed = [srv["server"] for srv in servers if "start_error" in srv]
    ok = bool(rows) and not failed and all(r["failed"] == 0 for r in rows)
    parts = [
        f"{srv['server']} " + "/".join(f"{r['output_throughput']:.0f}" for r in srv["rows"])
        for srv in started
    ]
    summary = (
        f"out tok/s at concurrency {'/'.join(map(str, ctx.sizes.serve.concurrency))}: "
        f"{'; '.join(parts)}"
        + "".join(
            f"; x {q['peer']} at {q['max_concurrency']}: {q['output_throughput']:.2f}"
            for q in data["ratios"]
        )
        + f"; exact lengths {sum(r['exact_lengths'] for r in rows)}/"
        f"{sum(r['completed'] for r in rows)}"
        + (f"; did not start: {', '.join(failed)}" if failed else "")
        + (f"; skipped: {', '.join(data['peers_skipped'])}" if "peers_skipped" in data else "")
    )
    summary += TOY_NOTE * ctx.interpret
    if "partial" in data:
        raise BudgetSpent(summary)
    return ok, summary


def serve_packages(data: dict) -> Path | None:
    """Make the serving packages importable (from the wheelhouse when absent); the directory the
    wheels went to, or None. Skips the stage, naming them, when they cannot be had."""
    wheels = install_wheelhouse(data) if missing_modules(SERVE_MODULES) else None
    lacking = missing_modules(SERVE_MODULES)
    if lacking:
        raise StageSkipped(
            f"pagedjax serve / bench serve need {', '.join(lacking)}, absent here and not in "
            f"{WHEELHOUSE}: run `make wheelhouse` on a machine with an index and copy "
            "wheelhouse/ beside this checkout"
        )
    return wheels


def measure(ctx: Context, budget: Budget, data: dict, peers: list[str], wheels) -> list[dict]:
    """Build the random model, then ``pagedjax bench serve`` against pagedjax and each peer in
    turn (each server started and stopped by it); each run's result."""
    from pagedjax.bench.serve_model import save_random_llama

    sv = ctx.sizes.serve
    scratch = Path(tempfile.mkdtemp(prefix="pagedjax-serve-"))
    try:
        t = time.perf_counter()
        model_dir = save_random_llama(
            scratch / "model", sv.model, dtype=sv.dtype, device=ctx.torch_device
        )
        if ctx.torch_device == "cuda":
            import torch

            torch.cuda.empty_cache()
        data["model"] = f"random Llama {sv.model['hidden_size']}x{sv.model['num_hidden_layers']}"
        data["model"] += f" (vocab {sv.model['vocab_size']}), {sv.dtype}, no EOS"
        data["build_model_s"] = time.perf_counter() - t
        common = serve_common_argv(ctx, model_dir, scratch)
        known = ",".join(p for p in peers if "=" not in p)
        compare = (["--compare", known] if known else []) + [
            a for p in peers if "=" in p for a in ("--peer", p)
        ]
        data["command"] = "pagedjax bench serve " + shlex.join(
            [*compare, *common, "--server-timeout", f"{sv.server_timeout_s:g}"]
        )
        results = []
        with server_environment(ctx, wheels):
            budget.check("pagedjax serve")
            timeout = min(sv.server_timeout_s, max(budget.left() - 10, 10))
            argv = [*common, "--start-pagedjax", "--server-timeout", f"{timeout:g}"]
            results.append(run_bench_serve(argv))
            for peer in peers:
                if budget.left() < 30:
                    data["partial"] = f"peer {peer} not run: the budget was spent on the others"
                    break
                flag = ["--peer", peer] if "=" in peer else ["--compare", peer]
                timeout = min(sv.server_timeout_s, budget.left())
                argv = [*common, "--no-pagedjax", *flag, "--server-timeout", f"{timeout:g}"]
                results.append(run_bench_serve(argv))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def record(ctx: Context, data: dict, servers: list[dict], rows: list[dict]) -> None:
    """The servers, rows, the plot and pagedjax's ratios to each peer into ``data``; the table
    printed."""
    from pagedjax.bench import serve_metrics

    data["servers"] = [
        serve_metrics.jsonable({k: v for k, v in srv.items() if k != "rows"}) for srv in servers
    ]
    data["rows"] = serve_metrics.jsonable(rows)
    say(
        f"  {'server':<14}{'conc':>6}{'ok':>6}{'fail':>6}{'exact':>7}{'out tok/s':>11}"
        f"{'TTFT p50':>11}{'TPOT p50':>11}{'E2E p50':>11}   (ms)"
    )
    for row in rows:
        say(serve_row_line(row))
    if rows:
        data["plot"] = serve_metrics.plot_sweep(
            rows, "max_concurrency", str(ctx.out / "bench_serve.png")
        )
    ours = {r["max_concurrency"]: r for r in rows if r["server"] == "pagedjax"}
    data["ratios"] = [
        {
            "peer": r["server"],
            "max_concurrency": c,
            "output_throughput": ours[c]["output_throughput"] / r["output_throughput"],
            "ttft_median": ratio(ours[c]["ttft"]["median"], r["ttft"]["median"]),
        }
        for r in rows
        if r["server"] != "pagedjax"
        and (c := r["max_concurrency"]) in ours
        and r["output_throughput"] > 0
    ]
    for q in data["ratios"]:
        say(
            f"  pagedjax / {q['peer']} at concurrency {q['max_concurrency']}: output tok/s "
            f"{q['output_throughput']:.2f}x, TTFT p50 {fmt_f(q['ttft_median'])}x"
        )
