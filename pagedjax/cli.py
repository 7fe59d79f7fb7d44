"""The pagedjax command line: generate, serve and bench (vLLM's flags)."""

from __future__ import annotations

import argparse
import sys

from pagedjax.engine.arg_utils import EngineArgs
from pagedjax.entrypoints.serve_args import add_serve_args, serve_options
from pagedjax.entrypoints.serve_ray.cli_args import add_ray_args
from pagedjax.utils.argparse_utils import FlexibleArgumentParser, HelpFormatter

DESCRIPTION = """\
pagedjax: vLLM's PagedAttention serving engine in JAX and Pallas.

  pagedjax generate --prompt TEXT   one completion (or --chat) from the command line
  pagedjax serve [MODEL]            an OpenAI-compatible HTTP server (vllm serve's flags)
  pagedjax bench KIND               throughput, latency, memory and serving benchmarks

Each command's --help lists its flags."""


def _initialize_distributed(args: argparse.Namespace) -> bool:
    """Join the multi-process job the flags (or env) describe; True on process 0."""
    from pagedjax import distributed

    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    import jax

    return jax.process_index() == 0


def _generate(args: argparse.Namespace) -> int:
    is_driver = _initialize_distributed(args)
    from pagedjax.entrypoints.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    llm = LLM(**EngineArgs.from_cli_args(args).keywords())
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.sampling_seed,
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    st = llm.get_stats()
    llm.close()
    if not is_driver:  # a follower ran the same steps; process 0 reports
        return 0
    completion = out.outputs[0]
    print(f"prompt ({len(out.prompt_token_ids)} tokens): {args.prompt!r}")
    print(f"output ({len(completion.token_ids)} tokens, finish={completion.finish_reason}):")
    print(completion.text)
    bs = llm.config.cache.block_size
    print(
        f"\nKV pool: {st.num_blocks_total} blocks x {bs} tokens of {st.kv_cache_dtype}; "
        f"peak {st.num_blocks_peak} blocks used ({st.kv_slots_allocated_peak} slots for "
        f"{st.kv_tokens_stored_peak} tokens), "
        f"utilization {st.kv_utilization:.3f}, now used {st.num_blocks_used}; "
        f"preemptions {st.num_preemptions}; compiled programs {st.num_compilations}"
    )
    if (spec := st.spec_decoding) is not None:
        print(
            f"speculation: {spec.num_accepted_tokens} of {spec.num_draft_tokens} proposed tokens "
            f"accepted ({spec.acceptance_rate:.1%}), {spec.mean_acceptance_length:.2f} tokens per "
            f"verification step ({spec.num_drafts} steps with proposals)"
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pagedjax.entrypoints.api_server import serve

    options = serve_options(args)  # checked before anything loads
    engine_args = EngineArgs.from_cli_args(args)
    multi = args.ray or args.coordinator_address or (args.num_processes or 1) > 1
    if options.engine_process and multi:
        raise ValueError(
            "--engine-process runs one engine process; not with --ray or a "
            "multi-process run (--coordinator-address, --num-processes)"
        )
    if args.ray:
        if engine_args.enable_lora:
            raise ValueError("--enable-lora is not served with --ray yet")
        from pagedjax.entrypoints.serve_ray.cli_args import serve_on_ray

        server = {"api_key": options.api_key, "limits": options.limits}
        server |= {"tool_config": options.tool_config, "public_metrics": options.public_metrics}
        server |= {"public_docs": options.public_docs, "chat_template": options.chat_template}
        server |= {"cors": options.cors}
        llm_kwargs = engine_args.keywords()
        del llm_kwargs["model"]  # the replicas take it apart
        return serve_on_ray(args, llm_kwargs, server)
    if not options.engine_process:  # the engine process is one process's whole engine
        _initialize_distributed(args)
    serve(engine_args, options)
    return 0


def _add_multiprocess_args(p: argparse.ArgumentParser) -> None:
    multi = p.add_argument_group(
        "multi-process (multi-host)",
        "run the same command on every host; process 0 schedules (and serves HTTP), the others "
        "follow it. Defaults come from PAGEDJAX_COORDINATOR_ADDRESS, PAGEDJAX_NUM_PROCESSES and "
        "PAGEDJAX_PROCESS_ID; --tensor-parallel-size must then count the devices of all hosts",
    )
    multi.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    multi.add_argument("--num-processes", type=int, default=None, help="processes in the job")
    multi.add_argument("--process-id", type=int, default=None, help="this one's, 0 .. N-1")


def _add_bench_parser(sub) -> None:
    from pagedjax.bench import latency, memory, serve, throughput

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, memory, serve")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, module, text in (
        ("throughput", throughput, "offline throughput vs Hugging Face transformers"),
        ("latency", latency, "TTFT / TPOT / inter-token latency at a Poisson request rate"),
        ("memory", memory, "KV utilisation, sharing savings, swap vs recompute"),
        ("serve", serve, "online serving over HTTP against any OpenAI-compatible server"),
    ):
        p = kinds.add_parser(name, help=text)
        module.build_parser(p)
        p.set_defaults(func=module.run)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Generate a completion for one prompt with the engine's options.",
        formatter_class=HelpFormatter,
    )
    EngineArgs.add_cli_args(gen)
    _add_multiprocess_args(gen)
    g = gen.add_argument_group("the prompt and its sampling")
    g.add_argument("--prompt", required=True, help="the prompt (the user message with --chat)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1)")
    g.add_argument("--sampling-seed", type=int, default=None, help="the request's seed")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    # One prompt, one sequence: the engine (and, on a CPU, its pool) is sized for one.
    gen.set_defaults(func=_generate, max_num_seqs=1)


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve an OpenAI-compatible HTTP API (vllm serve's flags; the model as "
        "`pagedjax serve MODEL` or --model).",
        formatter_class=HelpFormatter,
    )
    srv.add_argument(
        "model_tag", nargs="?", default=None, help="the model, as `vllm serve MODEL` (or --model)"
    )
    EngineArgs.add_cli_args(srv)
    _add_multiprocess_args(srv)
    add_serve_args(srv)
    add_ray_args(srv)
    srv.set_defaults(func=_serve)


def _add_compile_parser(sub) -> None:
    from pagedjax.aot.cli import build_parser

    p = sub.add_parser(
        "compile",
        help="compile the engine's programs for a TPU or GPU that is not here (shapes only)",
        description="Compile the engine's programs for a TPU slice or an NVIDIA GPU with that "
        "machine's own compiler, on this one, from the model's config alone; report each "
        "program's memory and what its optimized HLO holds (pagedjax/aot/).",
        formatter_class=HelpFormatter,
    )
    build_parser(p)


def main(argv: list[str] | None = None) -> int:
    parser = FlexibleArgumentParser(prog="pagedjax", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    _add_compile_parser(sub)
    args = parser.parse_args(argv)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            parser.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagedjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
