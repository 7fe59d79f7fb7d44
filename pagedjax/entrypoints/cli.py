"""The ``pagedjax`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from pagedjax.entrypoints.engine_args import add_engine_args, engine_kwargs
from pagedjax.serve_ray.cli_args import add_ray_args


def _initialize_distributed(args: argparse.Namespace) -> bool:
    """Join the multi-process job the flags (or env) describe; True on process 0."""
    from pagedjax import distributed

    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    import jax

    return jax.process_index() == 0


def _generate(args: argparse.Namespace) -> int:
    is_driver = _initialize_distributed(args)
    from pagedjax import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
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
    from pagedjax.entrypoints.api_server import (
        Cors,
        ServerLimits,
        check_api_key,
        load_chat_template,
        serve,
    )
    from pagedjax.entrypoints.openai.tools import ToolConfig
    from pagedjax.lora.updates import LoRAUpdates

    check_api_key(args.api_key)  # before anything loads
    chat_template = load_chat_template(args.chat_template)
    cors = None
    if args.allowed_origins is not None:
        methods, headers = args.allowed_methods, args.allowed_headers
        cors = Cors(args.allowed_origins, methods, headers, args.allow_credentials)
    tool_config = ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser)
    limits = ServerLimits(
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_response_logprobs=args.max_response_logprobs,
    )
    lora_kwargs = _lora_kwargs(args)  # checked before anything loads
    lora_updates = LoRAUpdates.from_options(
        args.enable_lora_runtime_updates, args.lora_allowed_roots
    )
    multi = args.ray or args.coordinator_address or (args.num_processes or 1) > 1
    if args.engine_process and multi:
        raise ValueError(
            "--engine-process runs one engine process; not with --ray or a "
            "multi-process run (--coordinator-address, --num-processes)"
        )
    if args.ray:
        if args.enable_lora:
            raise ValueError("--enable-lora is not served with --ray yet")
        from pagedjax.serve_ray.cli_args import serve_on_ray

        server = {"api_key": args.api_key, "limits": limits, "tool_config": tool_config}
        server |= {"public_metrics": args.public_metrics, "public_docs": args.public_docs}
        server |= {"chat_template": chat_template, "cors": cors}
        return serve_on_ray(args, engine_kwargs(args), server)
    if not args.engine_process:  # the engine process is one process's whole engine
        _initialize_distributed(args)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        limits=limits,
        public_metrics=args.public_metrics,
        public_docs=args.public_docs,
        tool_config=tool_config,
        warmup=args.warmup,
        warmup_all=args.warmup_all,
        background_compile=args.background_compile,
        lora_modules=args.lora_modules,
        lora_updates=lora_updates,
        engine_process=args.engine_process,
        chat_template=chat_template,
        cors=cors,
        **engine_kwargs(args),
        **lora_kwargs,
    )
    return 0


def _lora_kwargs(args: argparse.Namespace) -> dict:
    """LLM's LoRA keyword arguments from the serve flags (--lora-modules needs --enable-lora)."""
    for flag in ("lora_modules", "enable_lora_runtime_updates", "lora_allowed_roots"):
        if getattr(args, flag) and not args.enable_lora:
            raise ValueError(f"--{flag.replace('_', '-')} needs --enable-lora")
    if not args.enable_lora:
        return {}
    return dict(
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules: name=path."""
    from pagedjax.entrypoints.openai.serving_models import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_lora_args(srv: argparse.ArgumentParser) -> None:
    """Multi-LoRA serving: adapters requests select by their ``model`` (docs/LORA.md)."""
    lora = srv.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: a request's model names one",
    )
    lora.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which also turns them on): any client that passes "
        "the API key may make the server read a directory; confine them with "
        "--lora-allowed-roots",
    )
    lora.add_argument(
        "--lora-allowed-roots",
        nargs="+",
        default=None,
        metavar="DIR",
        help="directories that adapters loaded at run time must lie under",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve from the start: a name and a PEFT adapter directory each",
    )
    lora.add_argument(
        "--max-loras", type=int, default=1, help="adapters in one batch (device slots)"
    )
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded on the host (default: --max-loras)",
    )


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
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    # One prompt, one sequence: the engine (and, on a CPU, its pool) is sized for one.
    gen.set_defaults(func=_generate, max_num_seqs=1)


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    srv.add_argument(
        "model_tag", nargs="?", default=None, help="the model, as `vllm serve MODEL` (or --model)"
    )
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /ping (an "
        "empty key is an error)",
    )
    srv.add_argument(
        "--public-metrics", action="store_true", help="serve /metrics without the API key"
    )
    srv.add_argument(
        "--public-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json without the API key",
    )
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id clients use, and any aliases (default: --model as given)",
    )
    _add_compile_args(srv)
    _add_limit_args(srv)
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the model\'s calls are read by --tool-call-parser',
    )
    srv.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes (Qwen 2.5/3), llama3_json, pythonic",
    )
    srv.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a jinja chat template (a file, or the text) in place of the tokenizer's",
    )
    _add_cors_args(srv)
    _add_lora_args(srv)
    add_ray_args(srv)
    srv.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine in a process of its own (vLLM's engine core): this process only "
        "parses, tokenizes and answers HTTP, so that work never holds the engine's GIL",
    )
    srv.set_defaults(func=_serve)


def _add_cors_args(srv: argparse.ArgumentParser) -> None:
    """vLLM's cross-origin options; without --allowed-origins no browser origin is allowed."""
    srv.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=None,
        metavar="JSON",
        help="browser origins that may call the server, e.g. '[\"http://localhost:3000\"]' or "
        "'[\"*\"]' (default: none; vLLM's default is all)",
    )
    srv.add_argument("--allowed-methods", type=_string_list, default=["*"], metavar="JSON")
    srv.add_argument("--allowed-headers", type=_string_list, default=["*"], metavar="JSON")
    srv.add_argument(
        "--allow-credentials", action="store_true", help="let allowed origins send credentials"
    )


def _string_list(text: str) -> list[str]:
    """A JSON list of strings (an argparse type)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def _add_compile_args(srv: argparse.ArgumentParser) -> None:
    """When `serve` compiles its step programs: before answering, or in the background."""
    srv.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the common step programs (about a dozen model programs) before serving; "
        "--no-warmup: every program compiles on first use (default: on)",
    )
    srv.add_argument(
        "--warmup-all",
        action="store_true",
        help="compile every step program before serving (minutes on a CPU)",
    )
    srv.add_argument(
        "--background-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the server answers, compile the remaining programs on a background thread "
        "(else each compiles on first use; default: on)",
    )


def _add_limit_args(srv: argparse.ArgumentParser) -> None:
    """The server's limits on one request and on the queue (ServerLimits)."""
    srv.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="waiting requests before 503, and the most prompts one request may carry "
        "(default 256)",
    )
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20)
    srv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive before the request is dropped (408)",
    )
    srv.add_argument(
        "--max-stop-strings",
        type=int,
        default=64,
        help="stop strings (and stop_token_ids) one request may carry (default 64)",
    )
    srv.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=1024,
        help="characters in one stop string (default 1024)",
    )
    srv.add_argument(
        "--max-response-logprobs",
        type=int,
        default=1 << 20,
        help="logprob entries one response may carry, counted up front from echo, logprobs, n "
        "and max_tokens; a request over it is a 400 (default 1048576)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_bench_parser(sub)
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
