"""LLM, the offline API in vLLM's shape: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf

import numpy as np
from tqdm.auto import tqdm

from pagedjax import compilation
from pagedjax.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.entrypoints.chat_template import ChatOptions
from pagedjax.generation_config import check_generation_config
from pagedjax.lora.request import LoRARequest
from pagedjax.models.loader import default_model_path, load_model
from pagedjax.models.sharding import tensor_parallel_mesh
from pagedjax.outputs import EngineStats, RequestOutput
from pagedjax.pallas_kernels import native
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedjax.worker.runner import Runner

Prompt = str | list[int]
Params = SamplingParams | BeamSearchParams


class LLM:
    """Offline batched generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

    ``warmup=True`` compiles every program the engine's limits allow up front (see
    ``Runner.warmup``), so that no request waits for a compilation. ``speculative_config``:
    vLLM's dict, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 2, "prompt_lookup_max": 4}`` (pagedjax.spec_decode).
    ``kv_cache_dtype``: "auto" (the compute dtype), or "int8" / "fp8" for a KV pool of 8-bit
    pages with a float32 scale per token and kv head (about a quarter of float32's bytes
    per block, so more blocks fit).
    The KV pool holds ``num_blocks`` blocks if given, else ``kv_cache_space_gib``; else, on a
    GPU or TPU, ``gpu_memory_utilization`` of the device's memory (as JAX's allocator sees it:
    on a GPU, XLA_PYTHON_CLIENT_MEM_FRACTION of it) less what the weights took, the rest left
    for the step programs; on a CPU, up to 1 GiB.
    ``quantization``: "int8" or "fp8" weight-only quantization of the linear layers, a
    scale per output channel; "int8-g64" / "int8-g32": per 64 / 32 inputs of each
    (models/quant.py). A GGUF whose linear kernels are all Q8_0 keeps them in 8 bits with
    the file's scales: "int8-g32", which ``quantization`` may name (any other method is
    refused) and ``llm.engine.config.quantization`` reports.
    ``async_scheduling``: schedule and dispatch each step while the one before runs on the
    device, where that cannot change results (pagedjax/engine/step_loop.py).
    ``enable_lora``: serve LoRA adapters (``lora_request=`` on generate, chat and
    beam_search), at most ``max_loras`` in one batch, of rank up to ``max_lora_rank``,
    ``max_cpu_loras`` kept loaded on the host (docs/LORA.md).
    ``generation_config``: where the default sampling parameters come from (vLLM's): "auto",
    the model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
    max_new_tokens), for ``generate`` and ``chat`` without SamplingParams and for a server's
    requests that leave them unset; "vllm", none; or a folder's file.
    ``override_generation_config`` sets or replaces values (generation_config.json's names).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_space_gib: float | None = None,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        swap_space_gib: float = 4.0,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        cache_dir: str | None = None,
        warmup: bool = False,
        speculative_config: dict | None = None,
        async_scheduling: bool = True,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
    ):
        check_generation_config(generation_config, override_generation_config)  # before loading
        compilation.enable_persistent_cache()  # before anything compiles, the loader included
        native.prebuild()  # the CPU kernels compile while the model loads (seconds, once)
        mesh = tensor_parallel_mesh(tensor_parallel_size)
        loaded = load_model(
            model or default_model_path(),
            dtype=dtype,
            cache_dir=cache_dir,
            mesh=mesh,
            quantization=quantization,
        )
        config = EngineConfig(
            model=loaded.source,
            dtype=dtype,
            quantization=quantization,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            cache=CacheConfig(
                block_size,
                num_blocks,
                kv_cache_space_gib,
                swap_space_gib,
                enable_prefix_caching,
                kv_cache_dtype,
                gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs,
                resolve_max_model_len(max_model_len, loaded.config.max_context_len),
                max_num_batched_tokens,
                enable_chunked_prefill,
                preemption_mode,
            ),
            speculative_config=speculative_config,
            async_scheduling=async_scheduling,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
        )
        self.engine = LLMEngine(config, loaded)
        if warmup:
            sched = config.scheduler  # groups of several sequences swap in any mode
            swap = self.engine.block_manager.num_host_blocks > 0
            self.runner.warmup(sched.max_num_seqs, sched.token_budget, swap=swap)
        self._request_ids = itertools.count()
        self._driver_stats: EngineStats | None = None  # a follower's copy of the driver's

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation config defaults (temperature,
        top_p, top_k, min_p, repetition_penalty, max_tokens), what ``generate`` and ``chat``
        use when given none."""
        return SamplingParams(**self.engine.default_sampling_params)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def runner(self) -> Runner:
        return self.engine.runner

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.
        ``lora_request``: one adapter for every prompt, or a list with one (or None) per
        prompt."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts"
            )
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._run(prompts, list(sampling_params), use_tqdm, loras)

    def beam_search(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Beam search inside the engine; each output's completions are its best beams, best
        first (by cumulative logprob / length ** length_penalty)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search takes BeamSearchParams, got {params!r}")
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._run(prompts, [params] * len(prompts), use_tqdm, loras)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        use_tqdm=True,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        chat_template: str | None = None,
    ):
        """Apply the tokenizer's chat template to one conversation (or a list of them) and
        generate. vLLM's options: ``continue_final_message`` (with ``add_generation_prompt``
        False) leaves the last message open, so the model continues it; ``tools`` are shown to
        the template; ``chat_template_kwargs`` are more variables for it; ``chat_template``
        (jinja) stands in for the tokenizer's."""
        tok = self.tokenizer
        if tok is None or (tok.chat_template is None and chat_template is None):
            raise ValueError("this model's tokenizer has no chat template")
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            chat_template=chat_template,
        )
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [options.tokenize(tok, c, tools) for c in convs]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ---- LoRA adapters (vLLM's) -------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        return self.engine.pin_lora(lora_int_id)

    def _run(
        self,
        prompts: list[Prompt],
        params: list[Params],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ):
        if not self.engine.is_driver:
            return self._follow_run()
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        added = []
        try:
            prepared = []  # every prompt checked before any is queued
            for i, (request_id, prompt, p, lora) in enumerate(
                zip(ids, prompts, params, loras, strict=True)
            ):
                try:
                    prepared.append(self.engine.prepare_request(request_id, prompt, p, lora))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                # Only the final outputs are read here (vLLM's LLM asks the same): the engine's
                # own copy of the params, so no output is built at the steps in between.
                prepared[-1][2].output_kind = RequestOutputKind.FINAL_ONLY
            for request_id, request in zip(ids, prepared, strict=True):
                self.engine.enqueue(request_id, *request)
                added.append(request_id)
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
                while len(results) < len(ids):
                    for out in self.engine.step():
                        if out.finished and out.request_id in added:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException as e:
            for request_id in added:  # this call's requests leave the engine with it
                self.engine.abort_request(request_id)
            self.engine.broadcast("error", (isinstance(e, ValueError), str(e)))
            raise
        outputs = [results[r] for r in ids]
        self.engine.broadcast("return", (outputs, self.engine.get_stats()))
        return outputs

    def _follow_run(self) -> list[RequestOutput]:
        """A follower's generate/chat/beam_search: replay the driver's steps, then return the
        driver's outputs, so that every process of one program sees the same results."""
        op, payload = self.engine.follow(until=frozenset({"return", "error"}))
        if op == "error":
            bad_input, message = payload
            raise ValueError(message) if bad_input else RuntimeError(f"process 0: {message}")
        if op == "stop":
            raise RuntimeError("process 0 closed the engine")
        outputs, self._driver_stats = payload
        return outputs

    def get_stats(self) -> EngineStats:
        """The engine's statistics (a follower reports the driver's, as of its last run)."""
        if not self.engine.is_driver and self._driver_stats is not None:
            return self._driver_stats
        return self.engine.get_stats()

    def close(self) -> None:
        self.engine.close()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int | np.integer)
    ):
        return [prompts]
    return list(prompts)


def _per_prompt_loras(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt, from one for all or a list (vLLM's)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request: got {len(loras)} LoRARequests for {num_prompts} prompts")
    for lora in loras:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must hold LoRARequests or None, got {lora!r:.200}")
    return loras
