"""LLMEngine (add_request / step / abort_request) and LLM, the offline API in vLLM's shape.

One step: the scheduler decides (host, plain Python), the runner moves blocks and runs one jitted
step, then the engine appends tokens, forks samples and beams, checks stops and frees blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence as SequenceOf

import jax
import numpy as np
from tqdm.auto import tqdm

from models.llama import kv_pool_bytes_per_block
from models.loader import LoadedModel, default_model_path, load_model, load_tokenizer
from models.sharding import (
    min_over_processes,
    replicate_kv_heads,
    sharded_config,
    tensor_parallel_mesh,
)
from pagedjax.block_manager import BlockManager
from pagedjax.config import DEFAULT_CPU_KV_SPACE_GIB, CacheConfig, EngineConfig, SchedulerConfig
from pagedjax.distributed import Channel
from pagedjax.input_processor import (
    Capacity,
    InputProcessor,
    check_capacity,
    generation_config_eos_ids,
)
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.runner import Runner, ScheduledSeq
from pagedjax.sampler import SamplingRow
from pagedjax.sampling_params import BeamSearchParams, SamplingParams
from pagedjax.scheduler import Scheduler, SeqChunk
from pagedjax.sequence import Sequence, SequenceGroup, SequenceStatus

Prompt = str | list[int]
Params = SamplingParams | BeamSearchParams
_GOLDEN = 0x9E3779B9  # spreads the per-sample seeds of one request
_SAMPLING_EPS = 1e-5  # a temperature below this samples greedily (as vLLM)
logger = logging.getLogger("pagedjax.engine")


@dataclasses.dataclass
class EngineStats:
    num_blocks_total: int  # allocatable blocks (the null block excluded)
    num_blocks_used: int
    num_blocks_peak: int
    kv_slots_allocated_peak: int
    kv_tokens_stored_peak: int
    kv_utilization: float  # tokens stored / slots allocated, summed over every step of the run
    num_preemptions: int
    num_swapped_out: int  # blocks moved device -> host
    prefix_cache_hit_rate: float
    num_compilations: int
    num_swapped_in: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_aborted: int = 0  # requests the engine ended itself, each with a reason (never a client's)


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Params
    group: SequenceGroup
    seed: int
    finished_beams: list[tuple[list[int], float]] = dataclasses.field(default_factory=list)
    error: str | None = None  # why the engine ended it (its output carries this)

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)


class LLMEngine:
    """The serving engine: requests in, one step at a time, RequestOutputs out.

    In a multi-process run every process builds one; process 0's (the driver) takes requests
    and steps, the others (followers) replay its device operations in ``follow``.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        runner_factory=None,
    ):
        """``runner_factory(**kwargs)`` stands in for ``Runner(**kwargs)`` (tests drive the host
        side over a fake model with it)."""
        self.config = config
        tp = config.tensor_parallel_size
        mesh = tensor_parallel_mesh(tp)
        loaded = loaded or load_model(config.model, dtype=config.dtype, mesh=mesh)
        self.model_config = mc = loaded.config
        device_config = sharded_config(mc, tp)  # KV heads replicated when tp > num_kv_heads
        params = replicate_kv_heads(loaded.params, mc, tp)
        self.tokenizer = load_tokenizer(loaded)
        cache, sched = config.cache, config.scheduler
        limit = mc.max_context_len
        if sched.max_model_len > limit:
            raise ValueError(
                f"max_model_len={sched.max_model_len} exceeds the model's limit of {limit} tokens"
            )
        bytes_per_block = kv_pool_bytes_per_block(device_config, cache.block_size, config.dtype)
        num_blocks = cache.num_blocks or min_over_processes(self._auto_num_blocks(bytes_per_block))
        num_host_blocks = int(cache.swap_space_gib * 2**30 // bytes_per_block)
        self.block_manager = BlockManager(
            num_blocks,
            cache.block_size,
            num_host_blocks=num_host_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
        )
        capacity = Capacity(
            max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            token_budget=sched.token_budget,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            block_size=cache.block_size,
            num_blocks=num_blocks,
            num_usable_blocks=num_blocks - 1 - self.block_manager.watermark_blocks,
            num_host_blocks=num_host_blocks,
            vocab_size=mc.vocab_size,
        )
        check_capacity(capacity)
        self.input_processor = InputProcessor(capacity, self.tokenizer)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.token_budget,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            preemption_mode=sched.preemption_mode,
        )
        self.runner = (runner_factory or Runner)(
            config=device_config,
            params=params,
            num_blocks=num_blocks,
            block_size=cache.block_size,
            max_model_len=sched.max_model_len,
            num_host_blocks=num_host_blocks,
            mesh=mesh,
            channel=Channel() if jax.process_count() > 1 else None,
        )
        self._stopped = False  # multi-process: the driver has told the followers to stop
        eos = set(mc.eos_token_ids) | set(generation_config_eos_ids(loaded.source))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)

    def _auto_num_blocks(self, bytes_per_block: int) -> int:
        space = self.config.cache.kv_cache_space_gib
        if space is not None:
            return int(space * 2**30 // bytes_per_block)
        device = jax.local_devices()[0]
        mem = device.memory_stats() if device.platform != "cpu" else None
        if mem and "bytes_limit" in mem:  # each device holds 1/tp of every block (its heads)
            free = 0.9 * (mem["bytes_limit"] - mem.get("bytes_in_use", 0))
            return int(free // (bytes_per_block // self.config.tensor_parallel_size))
        return int(DEFAULT_CPU_KV_SPACE_GIB * 2**30 // bytes_per_block)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def check_request(self, prompt_token_ids: list[int], params: Params) -> None:
        """Raise ValueError, naming the limit, if the request could never run on this engine
        (the one admission check; add_request and the HTTP server both use it)."""
        self.input_processor.check(prompt_token_ids, params)

    @property
    def is_driver(self) -> bool:
        """Whether this process schedules (always, in a single-process run)."""
        return self.runner.channel is None or self.runner.channel.is_driver

    def _require_driver(self, what: str) -> None:
        if not self.is_driver:
            raise RuntimeError(
                f"{what}: process {jax.process_index()} follows process 0, which alone takes "
                "requests and steps; call follow() here"
            )

    def add_request(self, request_id: str, prompt: Prompt, params: Params) -> None:
        """Queue a request. Bad input, or a request that could never run, raises ValueError here
        and leaves the engine untouched. ``params`` is copied: later changes to it do nothing."""
        self._enqueue(request_id, *self.prepare_request(request_id, prompt, params))

    def prepare_request(
        self, request_id: str, prompt: Prompt, params: Params
    ) -> tuple[str | None, list[int], Params]:
        """Tokenize, copy and check a request without queueing it: (text, token ids, params)."""
        self._require_driver("add_request")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        try:
            params = self.input_processor.copy_params(params)
            text, ids = self.tokenize(prompt)
            self.check_request(ids, params)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        return text, ids, params

    def _enqueue(self, request_id: str, text: str | None, ids: list[int], params: Params) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        seed = getattr(params, "seed", None)
        if seed is None:
            seed = int(self._rng.integers(2**32))
        seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF  # 64-bit seeds fold into the sampler's 32
        seq = Sequence(next(self._seq_ids), ids, self.config.cache.block_size)
        group = SequenceGroup(request_id, [seq], time.monotonic(), params)
        self.requests[request_id] = _Request(request_id, text, ids, params, group, seed)
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(request_id)
            for seq in req.group.get_seqs():
                seq.finish_reason = seq.finish_reason or "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step; outputs of the requests it advanced.

        A request that fails on its own (its sampling rows, detokenisation, stop check, beam
        step or output) ends alone, with ``finish_reason="abort"`` and ``error`` set; the step
        and every other request go on."""
        self._require_driver("step")
        out = self.scheduler.schedule()
        runner, costs = self.runner, self.scheduler.cost_model
        touched = {g.request_id for g in out.aborted}
        for group in out.aborted:
            req = self.requests.get(group.request_id)
            if req is not None and req.error is None:
                req.error = f"the engine aborted the request: {group.abort_reason or 'no reason'}"
                logger.warning("request %r: %s", req.request_id, req.error)
            for seq in group.get_seqs():
                seq.finish_reason = seq.finish_reason or "abort"
        for pairs, move in (
            (out.blocks_to_swap_out, runner.swap_out),
            (out.blocks_to_swap_in, runner.swap_in),
        ):
            if pairs:
                start = time.perf_counter()
                move(pairs)
                jax.block_until_ready(runner.kv_pool)
                costs.observe_swap(time.perf_counter() - start, len(pairs))
        if out.blocks_to_copy:
            runner.copy_blocks(out.blocks_to_copy)
        if out.chunks:
            touched |= {c.group.request_id for c in out.chunks}
            self._execute(out.chunks)
        self.block_manager.record_usage()
        self.scheduler.drop_finished()
        outputs = []
        for request_id in sorted(touched):
            req = self.requests.get(request_id)
            if req is None:
                continue
            try:
                output = self._output(req)
            except Exception as e:
                self._fail(req, e)
                output = RequestOutput(
                    req.request_id, req.prompt, req.prompt_token_ids, [], True, error=req.error
                )
            outputs.append(output)
            if output.finished:
                del self.requests[request_id]
        return outputs

    def _fail(self, req: _Request, error: Exception) -> None:
        """End one request for a fault of its own; everything else keeps running."""
        if req.error is None:
            req.error = f"the request failed in the engine: {type(error).__name__}: {error}"
            logger.error("request %r: %s", req.request_id, req.error, exc_info=error)
            self.scheduler.num_aborted += 1
        self.scheduler.abort(req.request_id)
        for seq in req.group.get_seqs():
            self.scheduler.free_seq(seq, SequenceStatus.FINISHED_ABORTED)
            seq.finish_reason = seq.finish_reason or "abort"

    def _execute(self, chunks: list[SeqChunk]) -> None:
        prepared = []  # (chunk, request, sampling rows)
        for c in chunks:
            req = self.requests[c.group.request_id]
            try:
                rows = self._sample_rows(req, c) if c.completes else []
            except Exception as e:
                self._fail(req, e)
                continue
            prepared.append((c, req, rows))
        prepared = [(c, req, rows) for c, req, rows in prepared if req.error is None]
        if not prepared:
            return
        sched, num_top = [], 0
        for c, req, rows in prepared:
            seq, start = c.seq, c.seq.num_computed_tokens
            if rows:
                num_top = max(num_top, self._num_top_logprobs(req.params))
            sched.append(
                ScheduledSeq(
                    seq.get_token_ids()[start : start + c.num_tokens],
                    start,
                    self.block_manager.get_block_table(seq),
                    rows,
                )
            )
        start = time.perf_counter()
        result = self.runner.execute(sched, num_top)
        chunks = [c for c, _, _ in prepared]
        prefill_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        if prefill_tokens == sum(c.num_tokens for c in chunks):  # a pure prefill step
            self.scheduler.cost_model.observe_prefill(time.perf_counter() - start, prefill_tokens)

        row, beams = 0, {}
        for (c, req, _), s in zip(prepared, sched, strict=True):
            picks = [jax.tree.map(lambda x, i=row + i: x[i], result) for i in range(len(s.samples))]
            row += len(s.samples)
            if req.error is not None:  # failed earlier in this loop: its blocks are freed
                continue
            c.seq.num_computed_tokens += c.num_tokens
            self.block_manager.mark_blocks_computed(c.seq)
            if not picks:
                continue
            if req.is_beam_search:
                beams.setdefault(req.request_id, []).append((c.seq, picks[0]))
                continue
            try:
                for i, pick in enumerate(picks[1:], start=1):  # the first tokens of n samples
                    child = self._fork(req, c.seq, sample_index=i)
                    self._append(req, child, pick)
                self._append(req, c.seq, picks[0])
            except Exception as e:
                self._fail(req, e)
        for request_id, candidates in beams.items():
            req = self.requests[request_id]
            if req.error is None:
                try:
                    self._beam_step(req, candidates)
                except Exception as e:
                    self._fail(req, e)

    @staticmethod
    def _num_top_logprobs(params: Params) -> int:
        if isinstance(params, BeamSearchParams):
            return 2 * params.beam_width
        return params.logprobs or 0

    def _sample_rows(self, req: _Request, chunk: SeqChunk) -> list[SamplingRow]:
        p, seq = req.params, chunk.seq
        if req.is_beam_search:
            return [SamplingRow(position=seq.get_len())]
        first = len(chunk.group.get_seqs()) == 1 and seq.get_output_len() == 0
        indices = range(p.n) if first else [seq.sample_index]
        penalties = p.uses_penalties
        temperature = float(p.temperature) if p.temperature >= _SAMPLING_EPS else 0.0
        return [
            SamplingRow(
                temperature=temperature,
                top_k=min(max(p.top_k, 0), self.model_config.vocab_size),
                top_p=float(p.top_p),
                min_p=float(p.min_p),
                seed=(req.seed + i * _GOLDEN) % 2**32,
                position=seq.get_len(),
                presence_penalty=float(p.presence_penalty),
                frequency_penalty=float(p.frequency_penalty),
                repetition_penalty=float(p.repetition_penalty),
                prompt_token_ids=seq.prompt_token_ids if penalties else (),
                output_token_ids=seq.output_token_ids if penalties else (),
            )
            for i in indices
        ]

    def _fork(self, req: _Request, parent: Sequence, sample_index: int) -> Sequence:
        child = parent.fork(next(self._seq_ids))
        child.sample_index = sample_index
        self.block_manager.fork(parent, child)
        req.group.add(child)
        return child

    # ---- tokens in, stops -----------------------------------------------------------------

    def _append(self, req: _Request, seq: Sequence, pick) -> None:
        token = int(pick.tokens)
        seq.append_token_id(token, float(pick.logprobs))
        p = req.params
        if isinstance(p, SamplingParams) and p.logprobs is not None:
            top = dict(
                zip(
                    pick.top_token_ids[: p.logprobs].tolist(),
                    pick.top_logprobs[: p.logprobs].tolist(),
                    strict=True,
                )
            )
            seq.logprobs.append({token: float(pick.logprobs), **top})
        self._detokenize(seq, req)
        if isinstance(p, BeamSearchParams):
            return
        stopped = (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids
        if stopped or (p.stop and self._truncate_at_stop_string(seq, p.stop)):
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, "stop")
        elif (
            seq.get_output_len() >= p.max_tokens
            or seq.get_len() >= self.config.scheduler.max_model_len
        ):
            self._finish(seq, SequenceStatus.FINISHED_LENGTH_CAPPED, "length")

    def _finish(self, seq: Sequence, status: SequenceStatus, reason: str) -> None:
        self.scheduler.free_seq(seq, status)
        seq.finish_reason = reason

    def _detokenize(self, seq: Sequence, req: _Request) -> None:
        """Incremental detokenisation (vLLM's): decode a short window, keep only complete text."""
        if self.tokenizer is None:
            return
        skip = getattr(req.params, "skip_special_tokens", True)
        ids = seq.get_token_ids()
        prefix = self.tokenizer.decode(
            ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.text += full[len(prefix) :]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)

    @staticmethod
    def _truncate_at_stop_string(seq: Sequence, stops: list[str]) -> bool:
        """Cut seq.text at the earliest stop string. The text before ``stop_search_from`` held
        none, so a new match ends in the new text: each stop is searched in that tail only."""
        text, old = seq.text, seq.stop_search_from
        seq.stop_search_from = len(text)
        if len(text) == old:
            return False
        first = -1
        for s in stops:
            i = text.find(s, max(0, old - len(s) + 1))
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first < 0:
            return False
        seq.text = text[:first]
        return True

    # ---- beam search ----------------------------------------------------------------------

    def _beam_step(self, req: _Request, beams: list[tuple[Sequence, object]]) -> None:
        """Keep the beam_width best continuations of the live beams. A kept candidate forks its
        parent's block table; parents with no kept candidate are dropped and freed."""
        p: BeamSearchParams = req.params
        width = p.beam_width
        candidates = []
        for seq, pick in beams:
            for token, lp in zip(
                pick.top_token_ids[: 2 * width].tolist(),
                pick.top_logprobs[: 2 * width].tolist(),
                strict=True,
            ):
                candidates.append((seq.cumulative_logprob + lp, seq, token, lp))
        candidates.sort(key=lambda c: -c[0])
        kept = []
        for rank, (score, seq, token, lp) in enumerate(candidates):
            if not p.ignore_eos and token in self.eos_token_ids:
                if rank < width:  # an ended hypothesis among the best: keep it as a result
                    req.finished_beams.append(([*seq.output_token_ids, token], score))
                continue
            kept.append((seq, token, lp))
            if len(kept) == width:
                break
        chosen: dict[int, list] = {}
        for seq, token, lp in kept:
            chosen.setdefault(seq.seq_id, []).append((token, lp))
        for seq, _ in beams:
            picks = chosen.get(seq.seq_id)
            if not picks:
                self.scheduler.free_seq(seq, SequenceStatus.FINISHED_ABORTED)
                del req.group.seqs_dict[seq.seq_id]
                continue
            for token, lp in picks[1:]:
                self._fork(req, seq, sample_index=0).append_token_id(token, lp)
            seq.append_token_id(*picks[0])
        live = req.group.get_seqs(SequenceStatus.RUNNING)
        out_len = max((s.get_output_len() for s in live), default=0)
        done = (
            not live
            or out_len >= p.max_tokens
            or max(s.get_len() for s in live) >= self.config.scheduler.max_model_len
        )
        if not done and len(req.finished_beams) >= width:
            worst_kept = sorted(
                (self._beam_score(p, len(t), c) for t, c in req.finished_beams), reverse=True
            )[width - 1]
            best_live = max(
                self._beam_score(p, s.get_output_len(), s.cumulative_logprob) for s in live
            )
            done = best_live <= worst_kept
        if done:
            for seq in live:
                req.finished_beams.append((list(seq.output_token_ids), seq.cumulative_logprob))
                self._finish(seq, SequenceStatus.FINISHED_LENGTH_CAPPED, "length")

    @staticmethod
    def _beam_score(p: BeamSearchParams, length: int, cumulative_logprob: float) -> float:
        return cumulative_logprob / max(length, 1) ** p.length_penalty

    # ---- outputs --------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _output(self, req: _Request) -> RequestOutput:
        if req.is_beam_search:
            return self._beam_output(req)
        seqs = sorted(req.group.get_seqs(), key=lambda s: s.sample_index)
        want_logprobs = req.params.logprobs is not None
        completions = [
            CompletionOutput(
                index=s.sample_index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if want_logprobs else None,
                finish_reason=s.finish_reason,
            )
            for s in seqs
        ]
        finished = req.group.is_finished()  # before its first token a request has one seq
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, completions, finished, req.error
        )

    def _beam_output(self, req: _Request) -> RequestOutput:
        p = req.params
        finished = req.group.is_finished()
        if finished and req.error is None:
            hyps = req.finished_beams
        else:  # running, or ended by the engine: the live beams as they stand
            live = [s for s in req.group.get_seqs() if s.finish_reason in (None, "abort")]
            hyps = req.finished_beams + [
                (list(s.output_token_ids), s.cumulative_logprob) for s in live
            ]
        hyps = sorted(hyps, key=lambda h: -self._beam_score(p, len(h[0]), h[1]))[: p.beam_width]
        completions = [
            CompletionOutput(
                index=i,
                text=self._decode(tokens),
                token_ids=tokens,
                cumulative_logprob=cum,
                logprobs=None,
                finish_reason=(
                    "abort"
                    if req.error is not None
                    else "stop"
                    if tokens and tokens[-1] in self.eos_token_ids and not p.ignore_eos
                    else "length"
                )
                if finished
                else None,
            )
            for i, (tokens, cum) in enumerate(hyps)
        ]
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, completions, finished, req.error
        )

    # ---- inspection -----------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        bm = self.block_manager.get_stats()
        return EngineStats(
            num_blocks_total=bm.num_blocks_total,
            num_blocks_used=bm.num_blocks_used,
            num_blocks_peak=bm.num_blocks_peak,
            kv_slots_allocated_peak=bm.kv_slots_allocated_peak,
            kv_tokens_stored_peak=bm.kv_tokens_stored_peak,
            kv_utilization=bm.kv_utilization,
            num_preemptions=self.scheduler.num_preemptions,
            num_swapped_out=bm.num_swapped_out,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_compilations=self.runner.num_compilations,
            num_swapped_in=bm.num_swapped_in,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_aborted=self.scheduler.num_aborted,
        )

    # ---- multi-process --------------------------------------------------------------------

    def broadcast(self, op: str, payload=None) -> None:
        """Driver: send a message that followers' ``follow`` returns (no-op in one process, or
        once the engine is closed: the followers have gone)."""
        if self.runner.channel is not None and not self._stopped:
            self.runner.channel.send((op, payload))

    def keep_alive(self) -> None:
        """Driver, while idle: a "noop", so that followers waiting in the broadcast hear from
        it regularly (a collective backend may time out a wait of hours)."""
        self.broadcast("noop")

    def follow(self, until: frozenset[str] = frozenset({"stop"})) -> tuple[str, object]:
        """Follower: replay the driver's steps until one of the messages ``until`` (or "stop",
        sent by the driver's ``close``); returns it as ``(op, payload)``."""
        if self.is_driver:
            raise RuntimeError("follow() is for processes other than 0; process 0 drives")
        if self._stopped:
            raise RuntimeError("the engine is closed")
        while True:
            op, payload = self.runner.follow()
            if op == "stop":
                self._stopped = True
            if op in until or op == "stop":
                return op, payload

    def close(self) -> None:
        """Free the device KV pool and parameters; the engine is unusable afterwards. In a
        multi-process run every process calls it; the driver's tells the followers to stop."""
        if self.runner.channel is not None and not self._stopped:
            if self.is_driver:
                self.broadcast("stop")
                self._stopped = True
            else:
                self.follow()  # until the driver's "stop"
        self.runner.free_device_memory()
        for leaf in jax.tree.leaves(self.runner.params):
            leaf.delete()
        self.runner.params = None


class LLM:
    """Offline batched generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_space_gib: float | None = None,
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
    ):
        mesh = tensor_parallel_mesh(tensor_parallel_size)
        loaded = load_model(
            model or default_model_path(), dtype=dtype, cache_dir=cache_dir, mesh=mesh
        )
        mc = loaded.config
        config = EngineConfig(
            model=loaded.source,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            cache=CacheConfig(
                block_size, num_blocks, kv_cache_space_gib, swap_space_gib, enable_prefix_caching
            ),
            scheduler=SchedulerConfig(
                max_num_seqs,
                max_model_len or min(mc.max_context_len, 8192),
                max_num_batched_tokens,
                enable_chunked_prefill,
                preemption_mode,
            ),
        )
        self.engine = LLMEngine(config, loaded)
        self._request_ids = itertools.count()
        self._driver_stats: EngineStats | None = None  # a follower's copy of the driver's

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
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts"
            )
        return self._run(prompts, list(sampling_params), use_tqdm)

    def beam_search(
        self, prompts: Prompt | SequenceOf[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Beam search inside the engine; each output's completions are its best beams, best
        first (by cumulative logprob / length ** length_penalty)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search takes BeamSearchParams, got {params!r}")
        prompts = _as_prompt_list(prompts)
        return self._run(prompts, [params] * len(prompts), use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm=True):
        """Apply the tokenizer's chat template to one conversation (or a list of them)."""
        tok = self.tokenizer
        if tok is None or tok.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [
            tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs
        ]
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[Prompt], params: list[Params], use_tqdm: bool):
        if not self.engine.is_driver:
            return self._follow_run()
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        added = []
        try:
            prepared = []  # every prompt checked before any is queued
            for i, (request_id, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
                try:
                    prepared.append(self.engine.prepare_request(request_id, prompt, p))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
            for request_id, request in zip(ids, prepared, strict=True):
                self.engine._enqueue(request_id, *request)
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
