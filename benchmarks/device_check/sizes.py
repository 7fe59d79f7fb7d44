"""What the device run and the toy (CPU) run measure: models, workloads and seconds per stage."""

from __future__ import annotations

import dataclasses

# Llama-3-8B's config.json, as transformers reads it (weights are random; nothing is downloaded).
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)

# The same family at toy size (CPU smoke run).
TOY_LLAMA = dict(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_scaling=dict(LLAMA3_8B["rope_scaling"], original_max_position_embeddings=256),
    bos_token_id=1,
    eos_token_id=2,
)

# Stage 6's model: Llama-3.2-1B's shape with a 32000-word vocabulary (random weights, built on
# the device: no weights can be downloaded there, and the word tokenizer needs none).
SERVE_LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
)

SERVE_TOY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
)


@dataclasses.dataclass(frozen=True)
class ServeSizes:
    """Stage 6: the workload of ``pagedjax bench serve`` and the servers' settings."""

    model: dict  # transformers.LlamaConfig fields (random weights)
    dtype: str
    input_len: int
    output_len: int
    concurrency: tuple[int, ...]
    num_prompts: tuple[int, ...]  # per concurrency: the workload's first ones
    max_model_len: int
    max_num_seqs: int
    num_blocks: int  # pagedjax's pool, explicit: the same on every run, whatever memory is free
    peers: tuple[str, ...]  # started after pagedjax, if installed
    pagedjax_args: tuple[str, ...] = ()
    server_timeout_s: float = 120.0  # to /health (pagedjax compiles its step programs first)
    request_timeout_s: float = 60.0  # for each next byte: a stalled server cannot hang the stage


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything that differs between the device run and the toy (CPU) run."""

    # stage 2: one case = num_seqs sequences, contexts up to max_context tokens
    head_dim: int
    kernel_seqs: int
    kernel_max_context: int
    full_matrix: bool  # every (kind, dtype, GQA, block size); else a covering subset
    # stage 3a
    tiny_new_tokens: int
    tiny_preemption_modes: tuple[str, ...]
    # stage 3b / 5
    big_config: dict
    big_layers: int
    num_requests: int
    max_prompt_len: int
    max_output_len: int
    max_num_seqs: int
    kv_cache_space_gib: float
    # stage 4: arguments of benchmarks/paged_attention_gpu.py
    bench_argv: tuple[str, ...]
    # stage 5
    hf_batch_sizes: tuple[int, ...]
    # stage 6
    serve: ServeSizes
    # seconds per stage (soft: checked between steps; a stage is stopped at 1.5x + 30 s)
    budgets: dict


DEVICE = Sizes(
    head_dim=128,
    kernel_seqs=8,
    kernel_max_context=768,
    full_matrix=True,
    tiny_new_tokens=24,
    tiny_preemption_modes=("recompute", "swap"),
    big_config=LLAMA3_8B,
    big_layers=32,  # the whole depth: layers run under scan, so compile time does not grow with it
    num_requests=128,
    max_prompt_len=512,
    max_output_len=256,
    max_num_seqs=64,  # fewer decode buckets: fewer programs to compile in the cold run
    kv_cache_space_gib=16.0,
    bench_argv=("--batches", "8", "64", "--contexts", "2048", "16384"),
    hf_batch_sizes=(128, 64, 32),
    serve=ServeSizes(
        model=SERVE_LLAMA_1B,
        dtype="bfloat16",
        input_len=256,
        output_len=128,
        concurrency=(1, 16, 64),
        num_prompts=(4, 32, 64),
        max_model_len=512,
        max_num_seqs=64,
        num_blocks=2560,  # 64 sequences of 512 tokens need 2048 blocks of 16 (640 MiB in all)
        peers=("transformers",),
    ),
    budgets={
        "env": 15,
        "kernels": 90,
        "backends": 90,
        "engine_tiny": 60,
        "engine_8b": 150,
        "decode": 60,
        "peer": 75,
        "serve": 150,
        "probe": 60,
    },
)

TOY = Sizes(
    head_dim=32,
    kernel_seqs=3,
    kernel_max_context=64,
    full_matrix=False,
    tiny_new_tokens=12,
    tiny_preemption_modes=("recompute",),
    big_config=TOY_LLAMA,
    big_layers=2,
    num_requests=4,
    max_prompt_len=32,
    max_output_len=8,
    max_num_seqs=8,  # every request in one prefill step: few programs to compile
    kv_cache_space_gib=0.01,
    bench_argv=("--interpret", "--small", "--batches", "3", "--skip-jax"),  # JAX op: stage 2
    hf_batch_sizes=(4,),
    serve=ServeSizes(
        model=SERVE_TOY,
        dtype="float32",
        input_len=12,
        output_len=6,
        concurrency=(1, 2),
        num_prompts=(2, 4),
        max_model_len=64,
        max_num_seqs=4,
        num_blocks=64,
        peers=(),  # pagedjax alone: transformers serve takes a minute to start on this CPU
        pagedjax_args=("--no-warmup",),
        server_timeout_s=180.0,
    ),
    budgets={
        "env": 60,
        "kernels": 240,
        "backends": 300,
        "engine_tiny": 240,
        "engine_8b": 240,
        "decode": 240,
        "peer": 240,
        "serve": 240,
        "probe": 120,
    },
)
