"""EngineArgs (vLLM's ``vllm.engine.arg_utils.EngineArgs``): every engine option, declared once.

``pagedjax generate``'s and ``serve``'s flags (``EngineArgs.add_cli_args``), ``LLM``'s keywords
(``LLM(**kwargs)`` is ``EngineArgs(**kwargs)``), Ray Serve replicas' ``llm_kwargs`` and the
engine process all read these fields; ``create_engine_config`` builds the engine's frozen configs
from them and ``LLMEngine.from_engine_args`` the engine. vLLM's options that mean nothing here
are accepted and logged; those pagedjax lacks are refused naming the option
(engine/arg_options.py).
"""

from __future__ import annotations

import argparse
import dataclasses

from pagedjax.config import (
    KV_CACHE_DTYPES,
    MAX_MODEL_LEN_CAP,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    resolve_max_model_len,
)
from pagedjax.engine.arg_compat import VllmCompatArgs
from pagedjax.engine.arg_options import (
    add_fields,
    check_fields,
    log_inert_fields,
    option,
    refuse_unless,
)
from pagedjax.generation_config import check_generation_config
from pagedjax.lora.config import LoRAConfig
from pagedjax.sampling_params import MAX_LOGPROBS

GROUPS = {
    "model": "model and loading",
    "cache": "KV cache",
    "scheduler": "scheduler",
    "parallel": "parallelism",
    "lora": "LoRA adapters",
    "logging": "logging",
    "refused": "vLLM options pagedjax lacks (refused when set)",
    "inert": "vLLM options with no effect in pagedjax (accepted, and logged when set)",
}
# vLLM's --load-format values pagedjax reads; "mistral" repositories ship the Hugging Face files
# too, and those are what is read (engine/model_loading.py)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "mistral")
CONFIG_FORMATS = ("auto", "hf", "mistral")
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# LLM keywords of earlier pagedjax releases, and the field each names
KEYWORD_ALIASES = {"swap_space_gib": "swap_space"}

_no_float16 = refuse_unless(
    lambda d: d not in ("float16", "half"),
    "pagedjax computes in float32 or bfloat16 (auto picks bfloat16 on a GPU or TPU)",
)


def _cache_check(name: str):
    """A field check: the value as CacheConfig takes it (checked as the flag is parsed)."""
    return lambda value: CacheConfig(**{name: value})


def _check_speculative(value) -> None:
    from pagedjax.spec_decode.config import SpeculativeConfig

    SpeculativeConfig.of(value)


@dataclasses.dataclass
class EngineArgs(VllmCompatArgs):
    """The engine's options; see each field's help, or ``pagedjax serve --help``. vLLM's options
    pagedjax refuses or ignores are VllmCompatArgs' fields (engine/arg_compat.py)."""

    # ---- model and loading --------------------------------------------------------------------
    model: str | None = option(
        None,
        "HF checkpoint folder, hub id or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct GGUF)",
        group="model",
    )
    tokenizer: str | None = option(
        None, "the tokenizer's folder, hub id or .gguf file (default: the model's)", group="model"
    )
    revision: str | None = option(
        None, "the hub branch, tag or commit of the model (default: main)", group="model"
    )
    tokenizer_revision: str | None = option(
        None, "the hub revision of --tokenizer (default: --revision)", group="model"
    )
    download_dir: str | None = option(
        None, "where hub downloads go (default: the Hugging Face cache)", group="model"
    )
    hf_token: str | None = option(
        None,
        "the Hugging Face token for gated or private repos (default: the saved login)",
        group="model",
    )
    load_format: str = option(
        "auto",
        "the checkpoint's format: auto (a .gguf file or a folder of safetensors), safetensors, "
        "gguf; mistral reads the repository's Hugging Face files",
        choices=LOAD_FORMATS,
        group="model",
    )
    config_format: str = option(
        "auto",
        "the config's format; mistral reads config.json",
        choices=CONFIG_FORMATS,
        group="model",
    )
    hf_overrides: dict | None = option(
        None,
        "config.json values to override, as JSON, e.g. '{\"max_position_embeddings\": 4096}' "
        "(context, rope, norm epsilon, sliding window and special tokens)",
        metavar="JSON",
        group="model",
    )
    cache_dir: str | None = option(
        None,
        "where converted weights are cached (default: $PAGEDJAX_CACHE_DIR or ~/.cache/pagedjax)",
        group="model",
    )
    dtype: str = option(
        "float32",
        "the weights' and activations' dtype: float32 (float), bfloat16, or auto (float32 on a "
        "CPU, bfloat16 on a GPU or TPU)",
        choices=DTYPE_CHOICES,
        check=_no_float16,
        group="model",
    )
    quantization: str | None = option(
        None,
        "weight-only quantization of the linear layers: a scale per output channel, or per "
        "64 / 32 inputs of it (int8-g64, int8-g32). A Q8_0 GGUF keeps its 8-bit kernels and "
        "scales (int8-g32; another method is refused)",
        choices=QUANTIZATIONS,
        group="model",
    )
    seed: int = option(0, "the seed of requests that give none", group="model")
    max_model_len: int | None = option(
        None,
        f"longest prompt + output (default: the model's context, at most {MAX_MODEL_LEN_CAP})",
        group="scheduler",
    )
    max_logprobs: int = option(
        MAX_LOGPROBS,
        "the most logprobs (and prompt_logprobs) a request may ask for",
        check=refuse_unless(
            lambda k: isinstance(k, int) and 0 <= k <= MAX_LOGPROBS,
            f"must be an integer in [0, {MAX_LOGPROBS}] (the sampler's top-logprobs width)",
        ),
        group="model",
    )
    generation_config: str = option(
        "auto",
        "default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) for requests that leave them unset: auto, those of the model's "
        "generation_config.json (vLLM's default); vllm, none; or a folder's",
        metavar="auto|vllm|FOLDER",
        group="model",
    )
    override_generation_config: dict | None = option(
        None,
        "set or replace those defaults, e.g. '{\"temperature\": 0.5}'",
        metavar="JSON",
        check=lambda v: check_generation_config("auto", v),
        group="model",
    )
    speculative_config: dict | None = option(
        None,
        'speculative decoding, vLLM\'s dict as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\'',
        metavar="JSON",
        check=_check_speculative,
        group="model",
    )
    # ---- KV cache -----------------------------------------------------------------------------
    block_size: int = option(
        CacheConfig.block_size,
        "tokens per KV block: 8, 16, 32, 64 or 128",
        check=_cache_check("block_size"),
        group="cache",
    )
    num_blocks: int | None = option(
        None,
        "the KV pool's blocks (default: from memory)",
        flags=("--num-gpu-blocks-override",),
        check=_cache_check("num_blocks"),
        group="cache",
    )
    kv_cache_space_gib: float | None = option(
        None,
        "the KV pool's size in GiB, when --num-blocks is not given (default: on a CPU 1 GiB, or "
        "less if the engine's sequences cannot use it; on a GPU or TPU see "
        "--gpu-memory-utilization)",
        metavar="GIB",
        check=_cache_check("kv_cache_space_gib"),
        group="cache",
    )
    gpu_memory_utilization: float = option(
        CacheConfig.gpu_memory_utilization,
        "on a GPU or TPU, the share of the device's memory the weights, the KV pool and the "
        "step programs may use together; the KV pool gets what the weights leave. On a GPU, of "
        "JAX's share of it: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set",
        metavar="FRACTION",
        check=_cache_check("gpu_memory_utilization"),
        group="cache",
    )
    swap_space: float = option(
        CacheConfig.swap_space_gib,
        "host memory for swapped-out KV blocks, in GiB",
        metavar="GIB",
        group="cache",
    )
    enable_prefix_caching: bool = option(
        CacheConfig.enable_prefix_caching,
        "reuse the KV blocks of a prompt prefix computed before (default: on)",
        group="cache",
    )
    kv_cache_dtype: str = option(
        CacheConfig.kv_cache_dtype,
        "the KV cache's dtype: auto (the compute dtype), or int8 / fp8 pages with a float32 "
        "scale per token and kv head (more blocks in the same memory)",
        choices=KV_CACHE_DTYPES,
        group="cache",
    )
    # ---- scheduler ----------------------------------------------------------------------------
    max_num_seqs: int = option(
        SchedulerConfig.max_num_seqs, "the most sequences one step runs", group="scheduler"
    )
    max_num_batched_tokens: int | None = option(
        None,
        "tokens one step may compute (prompt chunks and decodes together; default: 2048, or "
        "--max-model-len if larger). Fewer: running requests' tokens come sooner while long "
        "prompts prefill; more: prompts prefill in fewer steps",
        group="scheduler",
    )
    enable_chunked_prefill: bool = option(
        SchedulerConfig.enable_chunked_prefill,
        "split a prompt longer than the step's token budget over several steps (default: on)",
        group="scheduler",
    )
    preemption_mode: str = option(
        SchedulerConfig.preemption_mode,
        "how a request gives its KV blocks back when memory runs out: recomputed later, "
        "swapped to host memory, or whichever costs less per request (auto)",
        choices=PREEMPTION_MODES,
        group="scheduler",
    )
    scheduling_policy: str = option(
        SchedulerConfig.policy,
        "the order requests are served in: fcfs (arrival), or priority (each request's "
        "priority, lower first, then arrival; a running request of lower priority is preempted "
        "for a waiting one of higher priority when blocks run out)",
        choices=SCHEDULING_POLICIES,
        group="scheduler",
    )
    async_scheduling: bool = option(
        True,
        "schedule and dispatch each step while the one before runs on the device, where that "
        "cannot change results (default: on)",
        group="scheduler",
    )
    # ---- parallelism --------------------------------------------------------------------------
    tensor_parallel_size: int = option(
        1, "split weights and KV heads across this many devices", flags=("-tp",), group="parallel"
    )
    # ---- LoRA ---------------------------------------------------------------------------------
    enable_lora: bool = option(
        False,
        "serve LoRA adapters: a request's lora_request (served: its model) names one",
        group="lora",
        check=refuse_unless(lambda v: isinstance(v, bool), "must be True or False"),
    )
    max_loras: int = option(1, "adapters in one batch (device slots)", group="lora")
    max_lora_rank: int = option(16, "the largest adapter rank", group="lora")
    max_cpu_loras: int | None = option(
        None, "adapters kept loaded on the host (default: --max-loras)", group="lora"
    )
    # ---- logging ------------------------------------------------------------------------------
    disable_log_stats: bool = option(
        False,
        "no periodic line of the engine's throughput, queues and KV use (LLM's default: off)",
        group="logging",
    )

    def __post_init__(self):
        check_fields(self)
        self._configs(model=self.model or "", max_model_len=self.max_model_len or 1)

    @staticmethod
    def add_cli_args(parser):
        """Add every option's flag to ``parser`` (a parser or an argument group); returns it."""
        add_fields(parser, EngineArgs, GROUPS)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    @classmethod
    def from_keywords(cls, model: str | None = None, **kwargs) -> EngineArgs:
        """LLM's keywords: the fields, and the older names of KEYWORD_ALIASES."""
        for old, new in KEYWORD_ALIASES.items():
            if old in kwargs:
                if new in kwargs:
                    raise ValueError(f"{old} and {new} name the same option; give one")
                kwargs[new] = kwargs.pop(old)
        return cls(model=model, **kwargs)

    def load_model(self):
        """Load the model these arguments name (engine/model_loading.py); logs each phase."""
        from pagedjax.engine import model_loading

        check_fields(self)  # fields may have been set since the arguments were made
        log_inert_fields(self)
        return model_loading.load(self)

    def create_engine_config(self, loaded=None) -> EngineConfig:
        """The engine's config. Without ``max_model_len`` the model's context decides it
        (``loaded``, a LoadedModel, or the model loaded here)."""
        from pagedjax.engine.model_loading import resolved_dtype

        if loaded is None and self.max_model_len is None:
            loaded = self.load_model()
        context = loaded.config.max_context_len if loaded is not None else 0
        model = loaded.source if loaded is not None else self.model
        length = resolve_max_model_len(self.max_model_len, context)
        return self._configs(model, length, resolved_dtype(self.dtype))

    def _configs(self, model: str, max_model_len: int, dtype: str = "float32") -> EngineConfig:
        cache = CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_cache_space_gib=self.kv_cache_space_gib,
            swap_space_gib=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            policy=self.scheduling_policy,
        )
        # the limits checked whether or not LoRA is on: a bad value is refused either way
        lora = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        return EngineConfig(
            model=model,
            dtype=dtype,
            quantization=self.quantization,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            cache=cache,
            scheduler=scheduler,
            speculative_config=self.speculative_config,
            async_scheduling=self.async_scheduling,
            lora=lora if self.enable_lora else None,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            max_logprobs=self.max_logprobs,
        )

    def keywords(self) -> dict:
        """The fields as LLM's keywords (what a Ray replica or the engine process is sent)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
