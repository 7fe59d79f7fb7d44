"""Online serving benchmark over HTTP, like `vllm bench serve`: any OpenAI-compatible server.

    pagedjax bench serve [--base-url URL] [--endpoint /v1/completions|/v1/chat/completions]
        [--model NAME] [--dataset-name sharegpt-like|random|json] [--num-prompts N]
        [--request-rate R] [--burstiness B] [--max-concurrency C] [--slo ttft=MS,tpot=MS] [--json]
    pagedjax bench serve --compare transformers [--disable-eos-copy DIR]
        [--sweep-concurrency 1,4,16 [--sweep-num-prompts 4,16,64]] [--repeats N]

Requests stream (temperature 0 unless --temperature) at arrival times drawn from a gamma process
of mean rate R (shape B; B=1 is Poisson; R=inf sends all at once), at most C in flight. Exact
output lengths: ``ignore_eos`` (and ``min_tokens``) are sent to servers that take them (pagedjax,
vLLM, SGLang); a probe request finds out, and a server that refuses them (transformers serve) is
named, with the way round it: --disable-eos-copy DIR writes a copy of the model without EOS.
Output tokens come from the server's usage, else from the tokenizer. Warm-up requests
(--num-warmups, the workload's first ones, one at a time) are excluded and reported apart.

--compare NAMES starts ``pagedjax serve`` and each named peer (transformers, vllm, sglang; or
--peer NAME=COMMAND) on the same weights on this machine, one at a time (each stopped before the
next starts), runs the identical workload against each and prints them side by side with ratios
(--start-pagedjax: pagedjax serve alone, started the same way; --no-pagedjax: the peers alone).
--sweep-rates / --sweep-concurrency repeat the run per value: one table and a PNG (--plot) of
throughput against latency per server; --sweep-num-prompts sends fewer of the workload's
requests at the small values. --repeats N times each row N times (workloads of seeds --seed,
--seed+1, ...): the row is the run of median output tok/s, with the min, median and max.
The command exits 1 when a server did not start or failed more than --max-failure-rate (default
0) of its timed requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

from pagedjax.bench import serve_metrics as metrics
from pagedjax.bench import vllm_result
from pagedjax.bench.serve_args import build_parser, extra_body, validate_args
from pagedjax.bench.serve_client import Target, probe_and_warm, run_requests, warm_up
from pagedjax.bench.serve_peers import (
    RunningServer,
    ServerSettings,
    StartError,
    custom_spec,
    known_spec,
    parse_server_args,
    write_eos_free_copy,
)
from pagedjax.bench.serve_workload import (
    arrival_times,
    count_tokens,
    json_requests,
    load_tokenizer,
    random_requests,
    sharegpt_like_requests,
)


def _embedded_model() -> str:
    from pagedjax.models.loader import default_model_path

    return default_model_path()


def _model_from_server(target: Target) -> str:
    """The first id of GET /v1/models: the name to send when --model is not given."""
    import urllib.request

    req = urllib.request.Request(target.base_url + "/v1/models", headers=target.headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["data"][0]["id"]
    except Exception as e:
        raise ValueError(
            f"--model not given and {target.base_url}/v1/models did not name one "
            f"({type(e).__name__}: {e})"
        ) from None


def _tokenizer_source(args, model: str) -> str:
    if args.tokenizer:
        return args.tokenizer
    if Path(model).expanduser().exists() or re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return model
    default = _embedded_model()
    if model in (Path(default).stem, Path(default).name):  # `pagedjax serve` with no --model
        return default
    raise ValueError(f"no tokenizer for the model name {model!r}: pass --tokenizer PATH")


def build_workloads(args, tokenizer) -> list:
    """--repeats workloads: the first drawn with --seed, each next one with the next seed."""
    return [build_workload(args, tokenizer, args.seed + r) for r in range(args.repeats)]


def build_workload(args, tokenizer, seed: int):
    requests = _dataset(args, tokenizer, seed)
    if args.output_len is not None and args.dataset_name != "random":  # vLLM's override
        requests = [dataclasses.replace(r, output_len=args.output_len) for r in requests]
    return requests


def _dataset(args, tokenizer, seed: int):
    if args.dataset_name == "sharegpt":  # vLLM's: its ShareGPT file, read as ours
        if not args.dataset_path:
            raise ValueError(
                "--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file); "
                "sharegpt-like draws ShareGPT's lengths without one"
            )
        return json_requests(
            args.dataset_path, tokenizer, args.num_prompts, args.max_prompt_len, 1 << 30
        )
    if args.dataset_name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            seed,
        )
    if args.dataset_name == "json":
        if not args.dataset_path:
            raise ValueError("--dataset-name json needs --dataset-path FILE")
        return json_requests(
            args.dataset_path, tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len
        )
    return sharegpt_like_requests(
        tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len, seed
    )


def _sweep(args) -> tuple[str | None, list]:
    if args.sweep_rates and args.sweep_concurrency:
        raise ValueError("give --sweep-rates or --sweep-concurrency, not both")
    if args.sweep_rates:
        return "request_rate", _numbers(args.sweep_rates, "--sweep-rates", float)
    if args.sweep_concurrency:
        return "max_concurrency", _numbers(args.sweep_concurrency, "--sweep-concurrency", int)
    return None, [None]


def _prompts_per_value(args, values: list) -> list[int]:
    """How many of the workload's requests each sweep value sends: all, or --sweep-num-prompts
    (one count per value, each at most --num-prompts: the workload's first ones)."""
    if not args.sweep_num_prompts:
        return [args.num_prompts] * len(values)
    counts = _per_value(args.sweep_num_prompts, "--sweep-num-prompts", values)
    if max(counts) > args.num_prompts:
        raise ValueError(
            f"--sweep-num-prompts {args.sweep_num_prompts!r}: each count must be at most "
            f"--num-prompts ({args.num_prompts})"
        )
    return counts


def _warmups_per_value(args, values: list) -> list[int] | None:
    """--sweep-num-warmups: the warm-up requests of each sweep value; None if not given."""
    if not args.sweep_num_warmups:
        return None
    return _per_value(args.sweep_num_warmups, "--sweep-num-warmups", values, least=0)


def _per_value(text: str, flag: str, values: list, least: int | None = None) -> list[int]:
    """One count per sweep value, from a comma-separated list (``_numbers``'s bounds)."""
    counts = _numbers(text, flag, int, least)
    if len(counts) != len(values) or values == [None]:
        raise ValueError(
            f"{flag} needs one count per sweep value ({len(values)} values), got {text!r}"
        )
    return counts


def _numbers(text: str, flag: str, kind, least=None) -> list:
    """The numbers of a comma-separated list, each > 0 (or >= ``least``)."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma-separated list of numbers, got {text!r}") from None
    if least is None and (not values or not all(v > 0 for v in values)):
        raise ValueError(f"{flag} values must be > 0, got {text!r}")
    if least is not None and (not values or min(values) < least):
        raise ValueError(f"{flag} values must be >= {least}, got {text!r}")
    return values


def bench_server(
    name: str, target: Target, workloads, tokenizer, args, slo, sweep, eos_free=False
) -> dict:
    """Probe, warm up, then the timed runs against one server: per sweep value, one run per
    workload (``workloads``: --repeats lists of requests, the random ones each drawn with its own
    seed, so that a repeat does not resend the prompts a prefix cache has just seen). With
    --sweep-num-warmups each value is warmed up at its own concurrency first, with the prompts
    of a seed no timed run uses (the server's warm-up is then the first value's). ``sweep``: the
    option swept (None: none) and its values (``_sweep``)."""
    from tqdm import tqdm

    knob, values = sweep  # the swept option (None: none) and its values (``_sweep``)
    requests = workloads[0]
    per_value = _warmups_per_value(args, values)
    first = args.num_warmups if per_value is None else 0
    found, warm = asyncio.run(probe_and_warm(target, requests, first, args.request_timeout))
    _note_probe(name, found, eos_free)
    warm_requests = (
        None if per_value is None else build_workload(args, tokenizer, args.seed + args.repeats)
    )
    rows, sent, failed = [], 0, 0
    selected = (  # vLLM's result: the metrics and percentiles asked
        vllm_result.parse_metrics(args.percentile_metrics),
        vllm_result.parse_percentiles(args.metric_percentiles),
    )
    counts = _prompts_per_value(args, values)
    for i, (value, count) in enumerate(zip(values, counts, strict=True)):
        rate = value if knob == "request_rate" else args.request_rate
        conc = value if knob == "max_concurrency" else args.max_concurrency
        label = name + (f" {knob}={value}" if knob else "")
        row_warm = []
        if per_value is not None and per_value[i]:
            row_warm = asyncio.run(
                warm_up(target, warm_requests, per_value[i], conc, args.request_timeout)
            )
            _count_output_tokens(row_warm, tokenizer)
            warm = warm or row_warm
        runs = []
        for rep, workload in enumerate(workloads):
            reqs = workload[:count]
            arrivals = arrival_times(len(reqs), rate, args.burstiness, args.seed + rep)
            desc = label + (f" run {rep + 1}/{len(workloads)}" if len(workloads) > 1 else "")
            bar = tqdm(total=len(reqs), desc=desc, disable=args.disable_tqdm, file=sys.stderr)
            results, duration = asyncio.run(
                run_requests(
                    target,
                    reqs,
                    arrivals,
                    max_concurrency=conc,
                    timeout_s=args.request_timeout,
                    progress=bar,
                )
            )
            bar.close()
            _count_output_tokens(results, tokenizer)
            sent += len(results)
            failed += sum(not r.success for r in results)
            run = metrics.summarize(results, duration, slo)
            run["vllm"] = vllm_result.serve_result(results, duration, slo, *selected)
            runs.append(run)
        row = metrics.pick_median_run(runs)
        row.update(server=name, request_rate=rate, max_concurrency=conc, burstiness=args.burstiness)
        if per_value is not None:
            row["warmup"] = metrics.warmup_summary(row_warm)
        rows.append(row)
    _count_output_tokens(warm, tokenizer)
    return {
        "server": name,
        "base_url": target.base_url,
        "model": target.model,
        "fields_sent": list(found.fields),
        "fields_refused": found.refused,
        "probe_note": found.note,
        "warmup": metrics.warmup_summary(warm),
        "rows": rows,
        "requests_sent": sent,  # timed requests of every row and repeat
        "requests_failed": failed,
    }


def _count_output_tokens(results, tokenizer) -> None:
    for r in results:
        if r.success and r.output_tokens is None:
            r.output_tokens = count_tokens(tokenizer, r.text)


def _note_probe(name: str, found, eos_free: bool) -> None:
    if found.note:
        print(f"{name}: {found.note}", file=sys.stderr)
    if "ignore_eos" in found.refused and eos_free:
        print(
            f"{name} refuses ignore_eos; it serves the EOS-free copy, so its lengths are exact "
            "all the same (the 'exact' figures say so)",
            file=sys.stderr,
        )
    elif "ignore_eos" in found.refused:
        print(
            f"{name} refuses ignore_eos ({found.refused['ignore_eos']}): its outputs may stop at "
            "EOS before max_tokens, so output lengths are not exact. For exact lengths, serve a "
            "copy of the model without EOS: `pagedjax bench serve --disable-eos-copy DIR --model "
            "SRC` writes one (with --compare, every started server serves that copy).",
            file=sys.stderr,
        )


def run_single(args, slo, knob, values) -> dict:
    target = Target(
        args.base_url,
        args.endpoint,
        args.model or "",
        args.api_key,
        args.temperature,
        extra_body(args),
    )
    if not target.model:
        target.model = _model_from_server(target)
    tokenizer = load_tokenizer(_tokenizer_source(args, target.model))
    workloads = build_workloads(args, tokenizer)
    sweep = (knob, values)
    server = bench_server(args.server_name, target, workloads, tokenizer, args, slo, sweep)
    return {"servers": [server]}


def server_specs(args, settings: ServerSettings) -> list:
    extra = parse_server_args(args.server_args)
    if args.no_pagedjax and args.start_pagedjax:
        raise ValueError("--start-pagedjax and --no-pagedjax contradict each other")
    names = [] if args.no_pagedjax else ["pagedjax"]
    names += [n.strip() for n in (args.compare or "").split(",") if n.strip()]
    specs = [known_spec(n, settings, extra.get(n, [])) for n in names]
    specs += [custom_spec(text, settings) for text in args.peer or ()]
    seen = [s.name for s in specs]
    if len(set(seen)) != len(seen):
        raise ValueError(f"each server once: got {seen}")
    if not specs:
        raise ValueError("no server to start: --no-pagedjax needs --compare or --peer")
    return specs


def run_compare(args, slo, knob, values) -> dict:
    model = args.model or _embedded_model()
    peers = [n.strip() for n in (args.compare or "").split(",") if n.strip()]
    if args.disable_eos_copy:
        model, made = write_eos_free_copy(model, args.disable_eos_copy)
        verb = "wrote" if made else "reusing"
        print(f"{verb} the EOS-free copy {model}; every server serves it", file=sys.stderr)
    elif "transformers" in peers and model.endswith(".gguf"):
        raise ValueError(
            "transformers serve cannot start from a GGUF file (its config names no "
            "architectures); pass --disable-eos-copy DIR: an HF copy without EOS, which every "
            "server then serves"
        )
    settings = ServerSettings(model, "127.0.0.1", args.dtype, args.seed, args.max_model_len)
    specs = server_specs(args, settings)
    tokenizer = load_tokenizer(args.tokenizer or model)
    workloads = build_workloads(args, tokenizer)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedjax-bench-serve-"))
    servers = []
    for spec in specs:  # one at a time: each is stopped before the next starts
        load = os.getloadavg()[0]
        with RunningServer(spec, settings, log_dir) as srv:
            print(f"starting {spec.name}: {shlex.join(srv.argv)}", file=sys.stderr)
            base = {"server": spec.name, "command": shlex.join(srv.argv), "log": str(srv.log_path)}
            try:
                ready_s = srv.wait_ready(args.server_timeout)
            except StartError as e:
                print(str(e), file=sys.stderr)
                servers.append({**base, "start_error": str(e), "rows": []})
                continue
            target = Target(
                srv.base_url,
                args.endpoint,
                spec.request_model,
                None,
                args.temperature,
                extra_body(args),
            )
            res = bench_server(
                spec.name,
                target,
                workloads,
                tokenizer,
                args,
                slo,
                (knob, values),
                eos_free=bool(args.disable_eos_copy),
            )
            servers.append({**base, **res, "ready_s": ready_s, "load_avg_before": load})
    return {"model": model, "log_dir": str(log_dir), "servers": servers}


def execute(args) -> dict | None:
    """Run what ``args`` ask, print the report, and return the result (None when only the
    EOS-free copy was asked for)."""
    validate_args(args)
    slo = metrics.parse_slo(args.slo)
    knob, values = _sweep(args)
    _prompts_per_value(args, values)  # a bad --sweep-num-prompts fails before any server starts
    _warmups_per_value(args, values)  # and so does a bad --sweep-num-warmups
    arrival_times(1, args.request_rate, args.burstiness, 0)  # validates rate and burstiness
    if args.compare or args.peer or args.start_pagedjax:
        result = run_compare(args, slo, knob, values)
    elif args.disable_eos_copy:
        path, made = write_eos_free_copy(args.model or _embedded_model(), args.disable_eos_copy)
        print(f"{'wrote' if made else 'already there:'} {path}")
        print(f"serve it, e.g. `transformers serve --continuous-batching {path}`")
        return None
    else:
        result = run_single(args, slo, knob, values)
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    result["knob"] = knob
    metrics.report(result, knob, args)
    if args.save_result or args.append_result:
        for path in vllm_result.save_serve_results(result, args):
            print(f"result: {path}")
    return result


def run(args) -> int:
    result = execute(args)
    if result is None:
        return 0
    if any("start_error" in s for s in result["servers"]):
        return 1
    return 1 if too_many_failures(result["servers"], args.max_failure_rate) else 0


def too_many_failures(servers: list[dict], max_rate: float) -> bool:
    """Whether a server failed more than ``max_rate`` of its timed requests (each one named)."""
    over = False
    for s in servers:
        sent, failed = s["requests_sent"], s["requests_failed"]
        if sent and failed / sent > max_rate:
            print(
                f"{s['server']}: {failed} of {sent} requests failed ({failed / sent:.1%}), over "
                f"--max-failure-rate {max_rate}",
                file=sys.stderr,
            )
            over = True
    return over


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
