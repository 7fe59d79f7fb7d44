"""LLM, the offline API in vLLM's shape: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as SequenceOf
from pathlib import Path

from tqdm.auto import tqdm

from pagedjax.config import EngineConfig
from pagedjax.engine.arg_utils import EngineArgs
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.stats_log import StatsLog
from pagedjax.entrypoints.chat_template import ChatOptions
from pagedjax.inputs import PromptType, TokensPrompt, is_one_prompt
from pagedjax.lora.request import LoRARequest
from pagedjax.metrics.offline import RequestCounts, engine_metrics
from pagedjax.metrics.reader import Metric
from pagedjax.models.loading.tokenizer import encode_text
from pagedjax.outputs import BeamSearchOutput, EngineStats, RequestOutput
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedjax.utils.log_setup import configure_default_logging
from pagedjax.worker.runner import Runner

Params = SamplingParams | BeamSearchParams
logger = logging.getLogger("pagedjax.entrypoints.llm")


class LLM:
    """Offline batched generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

    The keywords are EngineArgs' fields (pagedjax/engine/arg_utils.py, or ``pagedjax serve
    --help``: each flag is a keyword with underscores), vLLM's names: ``dtype``,
    ``max_model_len``, ``max_num_seqs``, ``block_size``, ``num_blocks``,
    ``gpu_memory_utilization``, ``enable_prefix_caching``, ``tensor_parallel_size``,
    ``speculative_config``, ``enable_lora``, ``generation_config`` and the rest; vLLM's options
    with no meaning here are accepted and logged, those pagedjax lacks refused by name.
    ``swap_space_gib`` is accepted for ``swap_space``. As vLLM's LLM, ``disable_log_stats``
    defaults to True. ``warmup=True`` compiles every program the engine's limits allow up front
    (``Runner.warmup``), so that no request waits for a compilation.

    The model loads with one log line per phase (pagedjax's logger, INFO, to stderr unless the
    application configured logging or PAGEDJAX_CONFIGURE_LOGGING=0).
    """

    def __init__(self, model: str | None = None, *, warmup: bool = False, **kwargs):
        configure_default_logging()
        kwargs.setdefault("disable_log_stats", True)
        self.engine_args = EngineArgs.from_keywords(model, **kwargs)  # checked before loading
        self.engine = LLMEngine.from_engine_args(self.engine_args)
        config = self.engine.config
        if warmup:
            sched = config.scheduler  # groups of several sequences swap in any mode
            swap = self.engine.block_manager.num_host_blocks > 0
            logger.info("Compiling every step program (warmup=True)")
            start, before = time.perf_counter(), self.runner.num_compilations
            self.runner.warmup(sched.max_num_seqs, sched.token_budget, swap=swap)
            done = self.runner.num_compilations - before
            logger.info("Compiled %d programs in %.1f s", done, time.perf_counter() - start)
        self._request_ids = itertools.count()
        self._driver_stats: EngineStats | None = None  # a follower's copy of the driver's
        self._stats_log = None if self.engine_args.disable_log_stats else StatsLog()
        self._request_counts = RequestCounts(config.scheduler.max_model_len)

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

    def get_tokenizer(self):
        """vLLM's: the model's tokenizer (transformers'; None for a model without one)."""
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def runner(self) -> Runner:
        return self.engine.runner

    def generate(
        self,
        prompts: PromptType | SequenceOf[PromptType],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
        priority: SequenceOf[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts. A prompt
        is a string, a list of token ids, a TextPrompt or a TokensPrompt (pagedjax/inputs.py).
        ``lora_request``: one adapter for every prompt, or a list with one (or None) per
        prompt. ``priority`` (vLLM's, with ``scheduling_policy="priority"``): one integer per
        prompt, lower served first."""
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
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        return self._run(prompts, list(sampling_params), use_tqdm, loras, priority)

    def beam_search(
        self,
        prompts: PromptType | SequenceOf[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search inside the engine, one BeamSearchOutput per prompt: vLLM's
        ``sequences`` (the prompt's tokens and text included) and ``outputs`` (the beams
        alone), best first (by cumulative logprob / length ** length_penalty)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search takes BeamSearchParams, got {params!r}")
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt_loras(lora_request, len(prompts))
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm, loras)
        tok = self.tokenizer
        decode = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: None)
        return [BeamSearchOutput.of(out, decode) for out in outputs]

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
        prompts = []
        for conversation in convs:  # each output's prompt is the rendered conversation
            text = options.render(tok, conversation, tools)
            ids = encode_text(tok, text, options.add_special_tokens)
            prompts.append(TokensPrompt(prompt_token_ids=ids, prompt=text))
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

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
        prompts: list[PromptType],
        params: list[Params],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
        priority: SequenceOf[int] | None = None,
    ):
        if not self.engine.is_driver:
            return self._follow_run()
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        added = []
        try:
            prepared = []  # every prompt checked before any is queued
            ranks = list(priority) if priority is not None else [0] * len(ids)
            for i, (request_id, prompt, p, lora, rank) in enumerate(
                zip(ids, prompts, params, loras, ranks, strict=True)
            ):
                try:
                    prepared.append(self.engine.prepare_request(request_id, prompt, p, lora, rank))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                # Only the final outputs are read here (vLLM's LLM asks the same): the engine's
                # own copy of the params, so no output is built at the steps in between.
                prepared[-1].params.output_kind = RequestOutputKind.FINAL_ONLY
            for request_id, request in zip(ids, prepared, strict=True):
                self.engine.enqueue(request_id, request)
                added.append(request_id)
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
                while len(results) < len(ids):
                    for out in self.engine.step():
                        if out.finished and out.request_id in added:
                            results[out.request_id] = out
                            bar.update(1)
                    if self._stats_log is not None and self._stats_log.due():
                        self._stats_log.tick(self.engine.get_stats())
        except BaseException as e:
            for request_id in added:  # this call's requests leave the engine with it
                self.engine.abort_request(request_id)
            self.engine.broadcast("error", (isinstance(e, ValueError), str(e)))
            raise
        outputs = [results[r] for r in ids]
        for out, p in zip(outputs, params, strict=True):
            self._request_counts.observe(out, getattr(p, "n", 1), p.max_tokens)
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

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's gauges and counters and the histograms of the requests this
        LLM ran, under vLLM's names (``vllm:num_requests_running``, ``vllm:prompt_tokens``,
        ``vllm:e2e_request_latency_seconds``, ...), as pagedjax.metrics.reader's Counter,
        Gauge, Histogram and Vector, labelled with the model's name."""
        name = self.engine_args.model or Path(self.config.model).stem
        labels = {"model_name": name, "engine": "0"}
        stats, block_size = self.get_stats(), self.config.cache.block_size
        return engine_metrics(stats, labels, block_size) + self._request_counts.metrics(labels)

    def close(self) -> None:
        self.engine.close()


def _as_prompt_list(prompts) -> list[PromptType]:
    return [prompts] if is_one_prompt(prompts) else list(prompts)


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
