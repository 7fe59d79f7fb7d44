"""``pagedjax bench latency --request-rate R``: serving latency at a request rate (TTFT, TPOT and
inter-token latency, as `vllm bench serve` reports them, offline and without HTTP). Without
--request-rate the command measures what `vllm bench latency` does (latency.py).

    pagedjax bench latency --request-rate R [--model M] [--num-requests N]
        [--max-prompt-len P] [--max-output-len O] [--no-warmup] [--json]

Requests (the seeded ShareGPT-like mix of ``pagedjax bench throughput``, random token ids, greedy,
EOS ignored) arrive as a Poisson process of rate R per second (``inf``: all at once) and are fed
to ``LLMEngine.add_request`` when their time comes; the engine steps continuously in the same
thread. Every new token is stamped when the step that produced it returns. Per request: TTFT =
first token - arrival; TPOT = (last token - first token) / (output tokens - 1); ITL = the gaps
between successive tokens. Reported: mean, median, p90, p99 of each (ms), plus request and output
token throughput. The same schedule (same lengths and arrival times, other token ids, so that
the timed run gets no prefix-cache hits) is replayed once beforehand (unless --no-warmup) so
that compilation is not counted as latency; programs still compiled while timed are reported.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from pagedjax.bench.throughput import synthetic_requests

PERCENTILES = (50, 90, 99)


def _summary(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    ms = np.asarray(values_s) * 1e3
    return {
        "mean_ms": float(ms.mean()),
        **{f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES},
    }


def serve(engine, requests, arrivals: np.ndarray, prefix: str = "lat") -> dict:
    """Feed requests at their arrival offsets (s) while stepping; per-request token times."""
    from pagedjax.sampling_params import SamplingParams

    order = np.argsort(arrivals, kind="stable")
    times: dict[str, list[float]] = {}
    arrived: dict[str, float] = {}
    seen: dict[str, int] = {}
    nxt, done = 0, 0
    start = time.perf_counter()
    while done < len(requests):
        now = time.perf_counter() - start
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = int(order[nxt])
            rid = f"{prefix}-{i}"
            r = requests[i]
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, r.prompt_token_ids, params)
            arrived[rid] = start + float(arrivals[i])
            times[rid], seen[rid] = [], 0
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[order[nxt]] - now, 0.05)))
            continue
        outs = engine.step()
        stamp = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            times[o.request_id].extend([stamp] * (n - seen[o.request_id]))
            seen[o.request_id] = n
            done += o.finished
    elapsed = time.perf_counter() - start
    ttft, tpot, itl = [], [], []
    for rid, ts in times.items():
        ttft.append(ts[0] - arrived[rid])
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
            itl.extend(np.diff(ts).tolist())
    out_tokens = sum(len(ts) for ts in times.values())
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft": _summary(ttft),
        "tpot": _summary(tpot),
        "itl": _summary(itl),
    }


def benchmark(args, llm, source: str) -> dict:
    """The Poisson run on ``llm`` (made with max_model_len at least the longest request)."""
    requests = synthetic_requests(
        args.num_requests,
        vocab_size=llm.model_config.vocab_size,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
        seed=args.seed,
    )
    rng = np.random.default_rng(args.seed + 2)
    if np.isinf(args.request_rate):
        arrivals = np.zeros(len(requests))
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / args.request_rate, len(requests)))
        arrivals -= arrivals[0]
    if not args.no_warmup:
        # The same schedule once, to compile the batch shapes it meets, with other token ids of
        # the same lengths: replaying the same prompts would let the timed run hit the prefix
        # cache and report a TTFT no new request sees.
        rng_w = np.random.default_rng(args.seed + 3)
        vocab = llm.model_config.vocab_size
        decoys = [
            dataclasses.replace(
                r, prompt_token_ids=rng_w.integers(3, vocab, len(r.prompt_token_ids)).tolist()
            )
            for r in requests
        ]
        serve(llm.engine, decoys, arrivals, prefix="warmup")
    compiled = llm.get_stats().num_compilations
    res = serve(llm.engine, requests, arrivals)
    res["compilations_while_timed"] = llm.get_stats().num_compilations - compiled
    return {
        "model": source,
        "request_rate": args.request_rate,
        "num_requests": len(requests),
        "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in requests])),
        "mean_output_len": float(np.mean([r.output_len for r in requests])),
        **res,
    }


def print_report(res: dict) -> None:
    print(
        f"{res['num_requests']} requests at {res['request_rate']} req/s (Poisson), mean prompt "
        f"{res['mean_prompt_len']:.1f}, mean output {res['mean_output_len']:.1f} tokens; "
        f"model {res['model']}"
    )
    print(
        f"elapsed {res['elapsed_s']:.2f} s, {res['requests_per_s']:.3f} requests/s, "
        f"{res['output_tokens_per_s']:.1f} output tokens/s, "
        f"{res['compilations_while_timed']} programs compiled while timed"
    )
    cols = ["mean_ms"] + [f"p{p}_ms" for p in PERCENTILES]
    print(f"{'(ms)':28}" + "".join(f"{c[:-3]:>10}" for c in cols))
    for key, label in (
        ("ttft", "time to first token"),
        ("tpot", "time per output token"),
        ("itl", "inter-token latency"),
    ):
        vals = res[key]
        print(
            f"{label:28}"
            + "".join(f"{vals[c]:10.1f}" if vals[c] is not None else f"{'-':>10}" for c in cols)
        )
