"""The engine's command-line flags (vLLM's names), shared by ``pagedjax generate``, ``serve`` and
``bench``'s engine runs, and the LLM keyword arguments they become."""

from __future__ import annotations

import argparse
import json

from pagedjax.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    MAX_MODEL_LEN_CAP,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    CacheConfig,
    SchedulerConfig,
)
from pagedjax.generation_config import check_generation_config


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory, hub id or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct GGUF)",
    )
    p.add_argument("--dtype", default=DTYPES[0], choices=DTYPES)
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="weight-only quantization of the linear layers: a scale per output channel, or "
        "per 64 / 32 inputs of it (int8-g64, int8-g32)",
    )
    add_cache_args(p)
    add_scheduler_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s dict as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\'',
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="default sampling parameters (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens) for requests that leave them unset: auto, those "
        "of the model's generation_config.json (vLLM's default); vllm, none; or a folder's",
    )
    p.add_argument(
        "--override-generation-config",
        type=_override_generation_config,
        default=None,
        metavar="JSON",
        help="set or replace those defaults, e.g. '{\"temperature\": 0.5}'",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and dispatch each step while the one before runs on the device, where "
        "that cannot change results (default: on)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split weights and KV heads across this many devices",
    )
    multi = p.add_argument_group(
        "multi-process (multi-host)",
        "run the same command on every host; process 0 schedules (and serves HTTP), the others "
        "follow it. Defaults come from PAGEDJAX_COORDINATOR_ADDRESS, PAGEDJAX_NUM_PROCESSES and "
        "PAGEDJAX_PROCESS_ID; --tensor-parallel-size must then count the devices of all hosts",
    )
    multi.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    multi.add_argument("--num-processes", type=int, default=None, help="processes in the job")
    multi.add_argument("--process-id", type=int, default=None, help="this one's, 0 .. N-1")


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """vLLM's KV-cache flags: the pool's dtype, blocks and size, prefix caching, swap space."""
    p.add_argument(
        "--kv-cache-dtype",
        default=CacheConfig.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the KV cache's dtype: auto (the compute dtype), or int8 / fp8 pages with a float32 "
        "scale per token and kv head (more blocks in the same memory)",
    )
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument(
        "--num-blocks", type=int, default=None, help="the KV pool's blocks (default: from memory)"
    )
    p.add_argument(
        "--kv-cache-space-gib",
        type=_cache_field("kv_cache_space_gib"),
        default=None,
        metavar="GIB",
        help="the KV pool's size in GiB, when --num-blocks is not given (default: on a CPU 1 "
        "GiB, or less if the engine's sequences cannot use it; on a GPU or TPU see "
        "--gpu-memory-utilization)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_cache_field("gpu_memory_utilization"),
        default=CacheConfig.gpu_memory_utilization,
        metavar="FRACTION",
        help="on a GPU or TPU, the share of the device's memory the weights, the KV pool and "
        "the step programs may use together; the KV pool gets what the weights leave. On a "
        "GPU, of JAX's share of it: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig.enable_prefix_caching,
        help="reuse the KV blocks of a prompt prefix computed before (default: on)",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=CacheConfig.swap_space_gib,
        metavar="GIB",
        help="host memory for swapped-out KV blocks, in GiB",
    )


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """vLLM's scheduler flags."""
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"longest prompt + output (default: the model's context, at most {MAX_MODEL_LEN_CAP})",
    )
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one step may compute (prompt chunks and decodes together; default: 2048, "
        "or --max-model-len if larger). Fewer: running requests' tokens come sooner while "
        "long prompts prefill; more: prompts prefill in fewer steps",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=SchedulerConfig.enable_chunked_prefill,
        help="split a prompt longer than the step's token budget over several steps (default: on)",
    )
    p.add_argument(
        "--preemption-mode",
        default=SchedulerConfig.preemption_mode,
        choices=PREEMPTION_MODES,
        help="how a request gives its KV blocks back when memory runs out: recomputed later, "
        "swapped to host memory, or whichever costs less per request (auto)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM's keyword arguments from the options ``add_engine_args`` defines (but --model)."""
    return dict(
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_space_gib=args.kv_cache_space_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space_gib=args.swap_space,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=args.speculative_config,
        async_scheduling=args.async_scheduling,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
    )


def _cache_field(name: str):
    """An argparse type: a float that CacheConfig accepts as ``name`` (checked before loading)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
            CacheConfig(**{name: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def _json_option(check):
    """An argparse type: JSON text whose value ``check`` accepts (a ValueError, which
    json.JSONDecodeError is too, becomes the usage error, before anything loads)."""

    def parse(text: str):
        try:
            value = json.loads(text)
            check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def _check_speculative_config(value) -> None:
    from pagedjax.spec_decode import SpeculativeConfig

    SpeculativeConfig.of(value)


# --speculative-config: a JSON object SpeculativeConfig accepts
_speculative_config = _json_option(_check_speculative_config)
# --override-generation-config: a JSON object of generation config values
_override_generation_config = _json_option(lambda value: check_generation_config("auto", value))
