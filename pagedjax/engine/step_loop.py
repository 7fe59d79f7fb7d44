"""The engine's step loop, with host/device overlap ("async scheduling", as vLLM V1's).

Synchronously, a step is: schedule, run on the device, wait for the sampled tokens, update the
sequences (append, stop, free), make outputs. With overlap, while step N runs on the device the
host schedules and dispatches step N+1, and only then fetches N's tokens and post-processes them
(while N+1 runs). Depth one: at most one step in flight beyond the one being post-processed.

How N+1 is scheduled before N's tokens are known: once N is dispatched, the scheduler counts it
ahead (``Scheduler.in_flight``, core/in_flight.py): each chunk computed, and a placeholder token
``-1 - r`` (row r of N's sampler output) for each sequence that samples. The scheduler then sees
exactly the lengths it would see after N, and schedules N+1 as it would have (a decode of the
placeholder at the same position, so a seeded row draws with the same key: ``fold_in(seed,
position)``). The runner replaces the placeholders on the device from N's token array, inside
the step's one program (``worker/step_program.py``). Before N is post-processed the scheduler
undoes its account and its own ``update_from_output`` runs on N's real tokens: the appends, stop
checks, forks and frees are those of a synchronous step.

A sequence that N finishes (EOS, stop string, length) or that is aborted was already scheduled in
N+1: its N+1 row is dropped, never appended or returned, and finishing it freed its blocks,
the slot N+1 writes included. Device operations run in dispatch order, so a block freed after N
and handed to another sequence in N+2 is written by N+1 first and by N+2 after (each step takes
the pool the one before returned, donated): the stale write cannot land on the new owner's data.

Overlap applies only where it cannot change what is computed; otherwise the step is the
synchronous one. A step is left in flight (advanced) only if every request in it is plain
sampling: SamplingParams with one sample per sequence (n == 1, or already forked), no
repetition / frequency / presence penalties (their history would miss the pending token), no
structured output (its mask follows the tokens), no prompt logprobs. The next step is scheduled
ahead only when it cannot preempt (a free block for every running sequence), no group is swapped
out, and neither a LongRoPE re-prefill nor a sliding window's run-ahead can take blocks; else the
step in flight is finished first. Steps are synchronous while the step profile times phases
(``bench throughput --profile``: its split waits for the device), and overlap is off entirely
with speculative decoding and in multi-process runs (followers replay the driver's device
operations from host arrays and cannot take the previous step's device tokens).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from pagedjax.core.scheduler import Scheduler, SchedulerOutput, SeqChunk
from pagedjax.engine.request_table import RequestTable
from pagedjax.inspection.step_profile import StepProfile
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.spec_decode.speculator import with_proposals
from pagedjax.worker import kv_cache
from pagedjax.worker.runner import ScheduledSeq

logger = logging.getLogger("pagedjax.engine.llm_engine")


@dataclasses.dataclass
class Dispatched:
    """A step on the device: the chunks it runs, in the runner's order, with their sampler rows."""

    chunks: list[SeqChunk]
    num_rows: list[int]  # sampler rows per chunk
    handle: object  # the runner's StepHandle (dispatch), or its StepOutput (execute)
    on_device: bool  # handle is a StepHandle, to fetch
    start: float  # perf_counter at dispatch
    prefill: bool  # every chunk a prompt chunk (timed for the preemption cost model)
    advanced: bool = False  # the scheduler counts it ahead (Scheduler.in_flight)


class StepLoop:
    """``step()`` over its collaborators: the scheduler (with its block manager), the runner,
    the request table (``fail``, ``store_prompt_logprobs``, ``emit``), the step history and
    profile, and the output processor's ``check_stops`` (a step's sequences checked together).
    ``enabled``: overlap host and device where it is safe (never with speculative decoding, nor
    with a runner that cannot dispatch ahead)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        requests: RequestTable,
        *,
        history,
        profile: StepProfile,
        vocab_size: int,
        check_stops: Callable,
        enabled: bool = False,
    ):
        self.scheduler, self.history = scheduler, history
        self.runner, self.requests, self.profile = runner, requests, profile
        self.vocab_size, self.check_stops = vocab_size, check_stops
        self.enabled = enabled and runner.dispatches_ahead
        self.pending: Dispatched | None = None  # counted ahead, its tokens not yet fetched
        self.num_overlapped = 0  # steps dispatched while the step before was still in flight
        self._touched: set[str] = set()  # requests whose outputs the next step() returns
        # Seconds since each request's tokens before, for those that got tokens in the last
        # step() (vLLM's inter-token latencies; a server's metrics read them): one per request
        self.token_gaps: list[float] = []

    def load(self, scheduler: Scheduler, history) -> None:
        """Take a loaded state's scheduler and history; the step in flight is dropped with the
        requests it ran."""
        self.pending = None
        self.scheduler, self.history = scheduler, history
        self.requests.scheduler = scheduler

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.token_gaps = []
        prev = self.pending
        if prev is not None and not self.scheduler.in_flight.can_schedule_ahead():
            self.drain()  # this step runs synchronously
            prev = None
        with self.profile.phase("schedule"):
            out = self._schedule()
        if prev is not None and (out.preempted or out.blocks_to_swap_in):  # ruled out above
            raise RuntimeError("scheduled ahead of a step in flight, yet it preempted or swapped")
        cur = self._dispatch(out.chunks, prev)
        if prev is not None:
            self.pending = None
            self.num_overlapped += cur is not None
            self._finish(prev)
        defer = cur is not None and cur.on_device and self._may_defer(cur)
        if cur is not None and not defer:
            self._finish(cur)
        self.scheduler.bm.record_usage()
        self.scheduler.drop_finished()
        with self.profile.phase("output"):
            outputs = self.outputs()
        if defer:
            cur.advanced = self.scheduler.in_flight.advance(cur.chunks, cur.num_rows)
            self.pending = cur if cur.advanced else None
        return outputs

    def drain(self) -> None:
        """Finish the step in flight (its outputs come with the next ``step()``)."""
        if self.pending is not None:
            d, self.pending = self.pending, None
            self._finish(d)
            self.scheduler.drop_finished()

    def has_outputs(self) -> bool:
        """Whether a step is in flight or a finished one's outputs wait for ``step()``."""
        return self.pending is not None or bool(self._touched)

    def outputs(self) -> list[RequestOutput]:
        touched, self._touched = sorted(self._touched), set()
        return [o for r in touched if (o := self.requests.emit(r)) is not None]

    # ---- its parts ----------------------------------------------------------------------------

    def _schedule(self) -> SchedulerOutput:
        sched, requests = self.scheduler, self.requests
        source = _Source(sched, requests.requests)  # what the history records from
        out = self.history.record(source, sched.schedule())
        for group in out.aborted:
            req = requests.get(group.request_id)
            if req is not None and req.error is None:
                req.error = f"the engine aborted the request: {group.abort_reason}"
                logger.warning("request %r: %s", req.request_id, req.error)
        self._touched |= {g.request_id for g in out.aborted}
        self._touched |= {c.group.request_id for c in out.chunks}
        kv_cache.apply_block_moves(self.runner, out, sched.cost_model)
        return out

    def _dispatch(self, chunks: list[SeqChunk], prev: Dispatched | None):
        """Start the chunks of requests whose sampling rows build; None if none runs. With
        overlap the runner dispatches without waiting, else it runs ``execute`` as ever (also
        while the step profile times phases: its split needs the device waited for)."""
        requests, by_id, bm = self.requests, self.requests.requests, self.scheduler.bm
        sched, ran, num_top, failed = [], [], 0, False
        for c in chunks:
            req = by_id[c.group.request_id]
            try:
                rows = req.sampling_rows(c, self.vocab_size)
            except Exception as err:
                requests.fail(req, err)
                failed = True
                continue
            num_top = max(num_top, req.num_top_logprobs if rows else 0)
            start, table = c.seq.num_computed_tokens, bm.get_block_table(c.seq)
            ids, rows = with_proposals(c, rows)
            spec, slot = len(c.spec_token_ids), c.lora_slot  # slot: its LoRA adapter's
            prompt_rows, seq_id = req.prompt_rows(c), c.seq.seq_id
            sched.append(ScheduledSeq(ids, start, table, rows, prompt_rows, spec, seq_id, slot))
            ran.append(c)
        seqs = sched
        if failed:  # a failed request's other chunks stay out too
            keep = [i for i, c in enumerate(ran) if by_id[c.group.request_id].error is None]
            seqs, ran = [sched[i] for i in keep], [ran[i] for i in keep]
        if not seqs:
            return None
        prefill = all(c.num_tokens - len(c.spec_token_ids) > 1 for c in ran)
        start = time.perf_counter()
        on_device = self.enabled and (prev is not None or not self.profile.enabled)
        if on_device:
            fill = prev is not None and any(s.token_ids[-1] < 0 for s in seqs)
            prev_tokens = prev.handle.tokens if fill else None
            handle = self.runner.dispatch(seqs, num_top, prev_tokens=prev_tokens)
        else:
            handle = self.runner.execute(seqs, num_top)
        return Dispatched(ran, [len(s.samples) for s in seqs], handle, on_device, start, prefill)

    def _finish(self, d: Dispatched) -> None:
        """Fetch a step's tokens and post-process them: appends, stops, frees (its outputs are
        made by the step() that calls this)."""
        sched, requests = self.scheduler, self.requests
        output = self.runner.fetch(d.handle) if d.on_device else d.handle
        for scores in output.prompt_scores:
            requests.store_prompt_logprobs(d.chunks[scores.seq_index].group.request_id, scores)
        result = output.sampled
        if d.prefill:
            tokens = sum(c.num_tokens for c in d.chunks)
            sched.cost_model.observe_prefill(time.perf_counter() - d.start, tokens)
        if d.advanced:  # the scheduler's account of it undone: its real tokens follow
            sched.in_flight.retreat()
            d.advanced = False
        chunks, result = self._live(d, result)
        with self.profile.phase("update"):
            update = sched.update_from_output(chunks, result) if chunks else None
            for request_id, error in update.failed.items() if update else ():
                requests.fail(requests[request_id], error)
            pairs = [(requests[g.request_id], s) for g, s in (update.new_tokens if update else ())]
            pairs = [(req, seq) for req, seq in pairs if req.error is None]
            now = time.monotonic()
            for req in {id(req): req for req, _ in pairs}.values():  # each request once
                gap = req.got_tokens(now)
                if gap is not None:
                    self.token_gaps.append(gap)
            for (req, seq), why in zip(pairs, self.check_stops(pairs), strict=True):
                if isinstance(why, Exception):
                    requests.fail(req, why)
                elif why:
                    sched.finish_seq(seq, why)
        self._touched |= {c.group.request_id for c in chunks}

    def _live(self, d: Dispatched, result):
        """The chunks still to account for and their rows of ``result``: a sequence finished or
        aborted since the step was dispatched (it was scheduled ahead) drops its row."""
        live = [
            i
            for i, c in enumerate(d.chunks)
            if not c.seq.is_finished()
            and (req := self.requests.get(c.group.request_id)) is not None
            and req.error is None
        ]
        if len(live) == len(d.chunks):
            return d.chunks, result
        starts = np.cumsum([0, *d.num_rows])
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in live] or [[]])
        rows = rows.astype(np.int64)
        return [d.chunks[i] for i in live], jax.tree.map(lambda x: x[rows], result)

    def _may_defer(self, d: Dispatched) -> bool:
        """Whether every request in the step is plain sampling (see the module doc)."""
        for c, n in zip(d.chunks, d.num_rows, strict=True):
            req = self.requests.get(c.group.request_id)
            if req is None or n > 1 or not isinstance(req.params, SamplingParams):
                return False
            p = req.params
            if p.uses_penalties or req.grammar is not None or req.prompt_logprobs is not None:
                return False
        return True


@dataclasses.dataclass
class _Source:
    """What the step history records from (inspection.StateSource)."""

    scheduler: Scheduler
    requests: dict
