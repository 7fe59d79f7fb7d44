"""The latency of one batch, as `vllm bench latency` measures it.

    pagedjax bench latency [--model M] [--input-len 32] [--output-len 128] [--batch-size 8]
        [--n 1] [--use-beam-search] [--num-iters-warmup 10] [--num-iters 30]
        [--output-json FILE] [--json] [engine flags: --max-model-len, --enable-prefix-caching,
        --max-num-seqs, --dtype, --seed, ...]

A batch of ``--batch-size`` prompts of ``--input-len`` random token ids is generated whole
(``LLM.generate``, ``--output-len`` tokens each, EOS ignored, temperature 1, top_p 1; with
``--use-beam-search``, ``LLM.beam_search`` of width ``--n``) ``--num-iters-warmup`` times
untimed, then ``--num-iters`` times timed. Reported, as vLLM does: the mean and standard
deviation of the iterations' latency and its 10th ... 99th percentiles, in seconds;
``--output-json`` writes vLLM's result file (``avg_latency``, ``std_latency``, ``latencies``,
``percentiles``). As in vLLM, prefix caching is off unless ``--enable-prefix-caching`` (every
iteration repeats the same prompts).

``--request-rate R`` measures something else instead: requests arriving at R per second
(Poisson) and their TTFT, TPOT and inter-token latency (latency_poisson.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedjax.bench import emit, latency_poisson, vllm_result


def _llm(args, max_model_len: int | None = None):
    """The LLM of the engine flags (EngineArgs, as vLLM's LLM.from_engine_args)."""
    from pagedjax.engine.arg_utils import EngineArgs
    from pagedjax.entrypoints.llm import LLM

    kwargs = EngineArgs.from_cli_args(args).keywords()
    if kwargs["max_model_len"] is None and max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return LLM(**kwargs)


def fixed_batch(args) -> dict:
    """vLLM's measurement: the timed iterations of one batch."""
    from pagedjax.sampling_params import BeamSearchParams, SamplingParams

    llm = _llm(args)
    limit = llm.config.scheduler.max_model_len
    if limit < args.input_len + args.output_len:
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceed the model's "
            f"max_model_len {limit}: raise --max-model-len"
        )
    rng = np.random.default_rng(args.seed)
    vocab = min(10000, llm.model_config.vocab_size)  # vLLM draws ids below 10000
    prompts = rng.integers(0, vocab, size=(args.batch_size, args.input_len)).tolist()
    params = SamplingParams(
        n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len
    )
    beams = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)

    def run_once() -> float:
        start = time.perf_counter()
        if args.use_beam_search:
            llm.beam_search(prompts, beams)
        else:
            llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        run_once()
    compiled = llm.get_stats().num_compilations
    latencies = [run_once() for _ in range(args.num_iters)]
    result = vllm_result.latency_result(latencies)
    result.update(
        model=llm.config.model,
        batch_size=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len,
        n=args.n,
        use_beam_search=args.use_beam_search,
        num_iters_warmup=args.num_iters_warmup,
        num_iters=args.num_iters,
        compilations_while_timed=llm.get_stats().num_compilations - compiled,
    )
    llm.close()
    return result


def print_report(res: dict) -> None:
    """vLLM's lines."""
    print(f"Avg latency: {res['avg_latency']} seconds")
    print(f"Std latency: {res['std_latency']} seconds")
    for p, value in res["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    print(
        f"(batch {res['batch_size']} x {res['input_len']} prompt tokens, {res['output_len']} "
        f"output tokens, {res['num_iters']} iterations after {res['num_iters_warmup']} warm-up; "
        f"{res['compilations_while_timed']} programs compiled while timed)"
    )


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from pagedjax.engine.arg_utils import EngineArgs

    parser = parser or argparse.ArgumentParser(prog="pagedjax bench latency")
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    parser.add_argument("--use-beam-search", action="store_true")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations")
    parser.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    parser.add_argument("--output-json", default=None, help="write vLLM's result JSON here")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(enable_prefix_caching=False)  # as vLLM: iterations repeat the prompts
    poisson = parser.add_argument_group(
        "Poisson arrivals (--request-rate)",
        "requests arrive at a rate instead, and TTFT, TPOT and inter-token latency are reported",
    )
    poisson.add_argument("--request-rate", type=float, default=None, help="requests/s; inf: burst")
    poisson.add_argument("--num-requests", type=int, default=32)
    poisson.add_argument("--max-prompt-len", type=int, default=128)
    poisson.add_argument("--max-output-len", type=int, default=32)
    poisson.add_argument("--no-warmup", action="store_true")
    return parser


def run(args) -> int:
    if args.request_rate is not None:
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
        if not args.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
        llm = _llm(args, args.max_prompt_len + args.max_output_len)
        res = latency_poisson.benchmark(args, llm, llm.config.model)
        llm.close()
        return emit(res, args.json, latency_poisson.print_report)
    for flag in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    res = fixed_batch(args)
    if args.output_json:
        vllm_result.write_json(args.output_json, res)
    return emit(res, args.json, print_report)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
