"""LLMEngine: add_request / step / abort_request, a thin loop over the rooms that do the work.

One step: the scheduler decides (host, plain Python), the runner moves blocks and runs one jitted
step, the scheduler takes the sampled tokens (append, fork, stop, free), and the output processor
turns them into text and RequestOutputs.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from pagedjax.config import EngineConfig
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.request_queue import check_priority
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceGroup
from pagedjax.distributed import Channel, DriverOrFollower
from pagedjax.engine.engine_lora import EngineLoRA, LoRARequest, lora_methods
from pagedjax.engine.input_processor import (
    Capacity,
    InputProcessor,
    check_capacity,
    eos_token_ids,
    truncated,
)
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.engine.request import PreparedRequest, Request
from pagedjax.engine.request_table import RequestTable
from pagedjax.engine.step_loop import StepLoop
from pagedjax.inspection import state as inspection
from pagedjax.inspection.step_profile import StepProfile, model_read_bytes
from pagedjax.models.loader import LoadedModel, load_model, load_tokenizer
from pagedjax.models.sharding import (
    replicate_kv_heads,
    sharded_config,
    tensor_parallel_mesh,
)
from pagedjax.outputs import EngineStats, RequestOutput
from pagedjax.sampling_params import BeamSearchParams, SamplingParams
from pagedjax.spec_decode.draft import with_draft_model
from pagedjax.spec_decode.speculator import make_speculator, stop_checker
from pagedjax.worker import kv_cache
from pagedjax.worker.runner import Runner, RunnerConfig
from pagedjax.worker.runner_protocol import ModelRunner

Prompt = str | list[int]
Params = SamplingParams | BeamSearchParams
logger = logging.getLogger("pagedjax.engine.llm_engine")


def _within_context(mc, max_model_len: int):
    """The model's config, once ``max_model_len`` is within its context limit."""
    if max_model_len > mc.max_context_len:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's limit of {mc.max_context_len} "
            "tokens"
        )
    return mc


class LLMEngine:
    """The serving engine: requests in, one step at a time, RequestOutputs out.

    In a multi-process run every process builds one; process 0's (the driver) takes requests
    and steps, the others (followers) replay its device operations in ``follow``
    (``self.processes``, a DriverOrFollower).
    ``runner_factory`` stands in for ``Runner`` (tests use a fake model; a ModelRunner,
    worker/runner_protocol.py), ``lora_loader`` for models/lora.py's adapter loader.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        runner_factory=None,
        lora_loader=None,
    ):
        self.config = config
        cache, sched, tp = config.cache, config.scheduler, config.tensor_parallel_size
        mesh = tensor_parallel_mesh(tp)
        loaded = loaded or load_model(
            config.model, dtype=config.dtype, mesh=mesh, quantization=config.quantization
        )
        if loaded.quantization is not None:  # e.g. a Q8_0 GGUF's kernels, kept in 8 bits
            config = self.config = dataclasses.replace(config, quantization=loaded.quantization)
        self.model_config = mc = _within_context(loaded.config, sched.max_model_len)
        self.tokenizer = load_tokenizer(loaded)
        device_config = sharded_config(mc, tp)  # KV heads replicated when tp > num_kv_heads
        num_blocks, num_host_blocks = kv_cache.pool_size(config, device_config, tp)
        self.block_manager = bm = BlockManager.for_model(num_blocks, num_host_blocks, cache, mc)
        capacity = Capacity.of(config, num_blocks, bm.watermark_blocks, num_host_blocks, mc)
        check_capacity(capacity)
        self.input_processor = InputProcessor(capacity, self.tokenizer)
        self.eos_token_ids = eos_token_ids(mc, loaded.source, self.tokenizer)
        # SamplingParams fields a request gets unless it sets them (the model's generation config)
        self.default_sampling_params = config.sampling_defaults(loaded.source)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.requests: dict[str, Request] = {}  # kept as one dict: load_state refills it
        stops = stop_checker(self.output_processor, self.requests)
        self.speculator = make_speculator(config.speculative_config, stops)
        self.profile = StepProfile()  # padding counts; phase times while profile.enabled
        spec_k = self.speculator.k if self.speculator else 0
        sizes = RunnerConfig.of(config, num_blocks, num_host_blocks, spec_k)
        self.runner: ModelRunner = (runner_factory or Runner)(
            device_config,
            replicate_kv_heads(loaded.params, mc, tp),
            sizes,
            mesh=mesh,
            channel=Channel() if jax.process_count() > 1 else None,
            profile=self.profile,
        )
        self.lora = EngineLoRA(config.lora, self.runner, mc, lora_loader)
        self.scheduler = Scheduler(
            bm,
            config.scheduler,
            eos_token_ids=self.eos_token_ids,
            speculator=self.speculator,
            lora=self.lora.admission,
        )
        self.profile.set_model_bytes(*model_read_bytes(self.runner))  # the target model's (MBU)
        self.runner = with_draft_model(config, self.runner)  # as is, unless a draft model proposes
        self.processes = DriverOrFollower(self.runner)
        self._rng = np.random.default_rng(config.seed)
        self.history = inspection.History()  # recent steps and finished requests (inspect())
        self.request_table = RequestTable(
            self.requests, self.output_processor, self.scheduler, self.speculator
        )
        self.steps = StepLoop(  # step(), overlapped where safe
            self.scheduler,
            self.runner,
            self.request_table,
            history=self.history,
            profile=self.profile,
            vocab_size=mc.vocab_size,
            check_stops=self.output_processor.check_stops,
            # no overlap with speculative decoding (a step's proposals follow the tokens before)
            enabled=config.async_scheduling and self.speculator is None,
        )

    @classmethod
    def from_engine_args(cls, engine_args) -> LLMEngine:
        """vLLM's: the engine of an EngineArgs (pagedjax/engine/arg_utils.py), its model loaded
        as the arguments say."""
        loaded = engine_args.load_model()
        engine = cls(engine_args.create_engine_config(loaded), loaded)
        engine.log_ready()
        return engine

    def log_ready(self) -> None:
        st, config = self.get_stats(), self.config
        sched = config.scheduler
        logger.info(
            "Engine ready: KV cache of %d blocks x %d tokens (%s), max_model_len=%d, "
            "max_num_seqs=%d, max_num_batched_tokens=%d",
            st.num_blocks_total,
            config.cache.block_size,
            st.kv_cache_dtype or config.dtype,
            sched.max_model_len,
            sched.max_num_seqs,
            sched.token_budget,
        )

    # ---- requests -------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: Params) -> None:
        """Raise ValueError, naming the limit, if the request could never run on this engine
        (the one admission check; add_request and the HTTP server both use it)."""
        self.input_processor.check(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: Params,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request, under the adapter ``lora_request`` if given. Bad input, or a
        request that could never run, raises ValueError here and leaves the engine untouched.
        ``params`` is copied: later changes to it do nothing. ``priority`` (vLLM's, with
        ``scheduling_policy="priority"``): lower values are served first."""
        prepared = self.prepare_request(request_id, prompt, params, lora_request, priority)
        self.enqueue(request_id, prepared)

    def prepare_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: Params,
        adapter: LoRARequest | None = None,
        priority: int = 0,
    ) -> PreparedRequest:
        """Tokenize, copy and check a request without queueing it, and load its adapter (a
        LoRARequest) into the host cache."""
        self.processes.require_driver("add_request")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        try:
            check_priority(priority, self.config.scheduler.policy)
            params = self.input_processor.copy_params(params)
            text, ids = self.input_processor.tokenize(prompt)
            k = getattr(params, "truncate_prompt_tokens", None)
            ids = truncated(ids, k, self.config.scheduler.max_model_len)
            self.check_request(ids, params)
            self.lora.add_adapter_of(adapter)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        return PreparedRequest(text, ids, params, adapter, priority)

    def enqueue(self, request_id: str, prepared: PreparedRequest) -> None:
        """Queue what prepare_request returned."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        text, ids, params = prepared.text, prepared.prompt_token_ids, prepared.params
        seed = getattr(params, "seed", None)
        if seed is None:
            seed = int(self._rng.integers(2**32))
        seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF  # 64-bit seeds fold into the sampler's 32
        seq = Sequence(self.scheduler.new_seq_id(), ids, self.config.cache.block_size)
        group = SequenceGroup(
            request_id, [seq], time.monotonic(), params, prepared.adapter, prepared.priority
        )
        request = Request(request_id, text, ids, group, seed)
        if getattr(params, "masks_early_stops", False):  # EOS (unless ignored) and stop ids
            eos = () if params.ignore_eos else self.eos_token_ids
            request.min_tokens_stops = tuple(sorted({*eos, *params.stop_token_ids}))
        self.requests[request_id] = request
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    # vLLM's add_lora, remove_lora, list_loras, pin_lora: those of engine/engine_lora.py
    add_lora, remove_lora, list_loras, pin_lora = lora_methods()

    def has_unfinished_requests(self) -> bool:  # or outputs not yet returned by step()
        return self.scheduler.has_unfinished() or self.steps.has_outputs()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step; outputs of the requests it advanced. With
        async scheduling (pagedjax/engine/step_loop.py) a step's tokens come with the next call.

        A request that fails on its own (sampling rows, detokenisation, stops, beams, output)
        ends alone, with ``finish_reason="abort"`` and ``error`` set; the others go on."""
        self.processes.require_driver("step")
        return self.steps.step()

    # ---- state ---------------------------------------------------------------------------

    def state(self) -> inspection.EngineState:
        """The host-side state (scheduler with its block manager, requests, seed generator,
        history), as held now: between steps, or with a step in flight (placeholders)."""
        return inspection.EngineState(self.scheduler, self.requests, self._rng, self.history)

    def load_state(self, state: inspection.EngineState) -> None:
        """Take ``state`` as this engine's (an engine of the same configuration's): the
        request table keeps its identity (the speculator's stop checker holds it)."""
        self.scheduler, self._rng, self.history = state.scheduler, state.rng, state.history
        self.scheduler.speculator = self.speculator
        self.block_manager = state.scheduler.bm
        self.requests.clear()
        self.requests.update(state.requests)
        self.steps.load(self.scheduler, self.history)  # and the request table's scheduler

    def inspect(self):
        self.steps.drain()  # a step in flight shows placeholders: finish it (outputs come later)
        return inspection.inspect(self.state())

    def snapshot(self):
        if jax.process_count() > 1:
            raise ValueError("snapshots cover single-process engines only")
        self.steps.drain()
        return inspection.snapshot(self.state(), self.config, self.runner.kv_cache)

    def restore(self, snap) -> None:
        """Put the engine in the snapshot's state; its requests in flight are dropped. A
        snapshot of another configuration raises ValueError and changes nothing."""
        state = inspection.load(snap, self.config)  # checked before anything is touched
        self.steps.pending = None  # its requests are dropped with the others in flight
        self.load_state(state)
        self.runner.kv_cache.import_blocks(
            snap.device_blocks, snap.kv, snap.host_blocks, snap.host_kv
        )

    # ---- processes (multi-process runs; pagedjax/distributed.py) ---------------------------

    @property
    def is_driver(self) -> bool:
        return self.processes.is_driver

    def broadcast(self, op: str, payload=None) -> None:
        self.processes.broadcast(op, payload)

    def keep_alive(self) -> None:
        self.processes.keep_alive()

    def follow(self, until: frozenset[str] = frozenset({"stop"})) -> tuple[str, object]:
        return self.processes.follow(until)

    def close(self) -> None:
        self.processes.close()

    def get_stats(self) -> EngineStats:
        bm = self.block_manager.get_stats()
        num_overlapped = self.steps.num_overlapped
        return EngineStats.of(bm, self.scheduler, self.runner, self.profile, num_overlapped)
