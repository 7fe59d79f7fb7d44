"""The engine's step loop, with host/device overlap ("async scheduling", as vLLM V1's).

Synchronously, a step is: schedule, run on the device, wait for the sampled tokens, update the
sequences (append, stop, free), make outputs. With overlap, while step N runs on the device the
host schedules and dispatches step N+1, and only then fetches N's tokens and post-processes them
(while N+1 runs). Depth one: at most one step in flight beyond the one being post-processed.

How N+1 is scheduled before N's tokens are known: once N is dispatched, each sequence that
samples in it is *advanced*: its chunk counted as computed and a placeholder token appended, id
``-1 - r`` for row r of N's sampler output, in ``seq.token_ids`` only (its output tokens, what
sampling rows and outputs read, are the real ones so far). The scheduler then sees exactly the
lengths it would see after N, and schedules N+1 as it would have (a decode of the placeholder at
the same position, so a seeded row draws with the same key: ``fold_in(seed, position)``). The
runner replaces the placeholders on the device from N's token array, inside the step's one
program (``worker/step_program.py``). Before N is post-processed its advances are undone and the
scheduler's own ``update_from_output`` runs on N's real tokens: the appends, stop checks, forks
and frees are those of a synchronous step.

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
from typing import TYPE_CHECKING

import jax
import numpy as np

from pagedjax.core.scheduler import SchedulerOutput, SeqChunk
from pagedjax.core.sequence import SequenceStatus
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.spec_decode.speculator import with_proposals
from pagedjax.worker import kv_cache
from pagedjax.worker.runner import ScheduledSeq
from pagedjax.worker.step_program import placeholder

if TYPE_CHECKING:
    from pagedjax.engine import LLMEngine

logger = logging.getLogger("pagedjax.engine")


@dataclasses.dataclass
class Dispatched:
    """A step on the device: the chunks it runs, in the runner's order, with their sampler rows."""

    chunks: list[SeqChunk]
    num_rows: list[int]  # sampler rows per chunk
    handle: object  # the runner's StepHandle (dispatch), or its host output (execute)
    on_device: bool  # handle is a StepHandle, to fetch
    start: float  # perf_counter at dispatch
    prefill: bool  # every chunk a prompt chunk (timed for the preemption cost model)
    advanced: list[tuple[SeqChunk, bool]] = dataclasses.field(default_factory=list)


class StepLoop:
    """``step()`` for an LLMEngine; ``enabled``: overlap host and device where it is safe."""

    def __init__(self, engine: LLMEngine, enabled: bool):
        self.engine = engine
        runner = engine.runner
        self.enabled = (
            enabled
            and engine.speculator is None
            and getattr(runner, "channel", None) is None
            and hasattr(runner, "dispatch")
        )
        self.pending: Dispatched | None = None  # advanced, its tokens not yet fetched
        self.num_overlapped = 0  # steps dispatched while the step before was still in flight
        self._touched: set[str] = set()  # requests whose outputs the next step() returns

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        e, prev = self.engine, self.pending
        if prev is not None and not self._can_schedule_ahead():
            self.drain()  # this step runs synchronously
            prev = None
        with e.profile.phase("schedule"):
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
        e.block_manager.record_usage()
        e.scheduler.drop_finished()
        with e.profile.phase("output"):
            outputs = self.outputs()
        if defer:
            self._advance(cur)
            self.pending = cur if cur.advanced else None
        return outputs

    def drain(self) -> None:
        """Finish the step in flight (its outputs come with the next ``step()``)."""
        if self.pending is not None:
            d, self.pending = self.pending, None
            self._finish(d)
            self.engine.scheduler.drop_finished()

    def has_outputs(self) -> bool:
        """Whether a step is in flight or a finished one's outputs wait for ``step()``."""
        return self.pending is not None or bool(self._touched)

    def outputs(self) -> list[RequestOutput]:
        touched, self._touched = sorted(self._touched), set()
        return [o for r in touched if (o := self.engine._output(r)) is not None]

    # ---- its parts ----------------------------------------------------------------------------

    def _schedule(self) -> SchedulerOutput:
        e = self.engine
        e.scheduler.speculator = e.speculator  # also on a restored scheduler's
        out = e.history.record(e, e.scheduler.schedule())
        for group in out.aborted:
            req = e.requests.get(group.request_id)
            if req is not None and req.error is None:
                req.error = f"the engine aborted the request: {group.abort_reason}"
                logger.warning("request %r: %s", req.request_id, req.error)
        self._touched |= {g.request_id for g in out.aborted}
        self._touched |= {c.group.request_id for c in out.chunks}
        kv_cache.apply_block_moves(e.runner, out, e.scheduler.cost_model)
        return out

    def _dispatch(self, chunks: list[SeqChunk], prev: Dispatched | None):
        """Start the chunks of requests whose sampling rows build; None if none runs. With
        overlap the runner dispatches without waiting, else it runs ``execute`` as ever (also
        while the step profile times phases: its split needs the device waited for)."""
        e = self.engine
        sched, ran, num_top = [], [], 0
        for c in chunks:
            req = e.requests[c.group.request_id]
            try:
                rows = req.sampling_rows(c, e.model_config.vocab_size)
            except Exception as err:
                e._fail(req, err)
                continue
            num_top = max(num_top, req.num_top_logprobs if rows else 0)
            start, table = c.seq.num_computed_tokens, e.block_manager.get_block_table(c.seq)
            ids, rows = with_proposals(c, rows)
            num_spec = len(c.spec_token_ids)
            sched.append(ScheduledSeq(ids, start, table, rows, req.prompt_rows(c), num_spec))
            ran.append(c)
        keep = [i for i, c in enumerate(ran) if e.requests[c.group.request_id].error is None]
        if not keep:
            return None
        seqs, ran = [sched[i] for i in keep], [ran[i] for i in keep]
        prefill = all(c.num_tokens - len(c.spec_token_ids) > 1 for c in ran)
        start = time.perf_counter()
        on_device = self.enabled and (prev is not None or not e.profile.enabled)
        if on_device:
            fill = prev is not None and any(s.token_ids[-1] < 0 for s in seqs)
            prev_tokens = prev.handle.tokens if fill else None
            handle = e.runner.dispatch(seqs, num_top, prev_tokens=prev_tokens)
        else:
            handle = e.runner.execute(seqs, num_top)
        return Dispatched(ran, [len(s.samples) for s in seqs], handle, on_device, start, prefill)

    def _finish(self, d: Dispatched) -> None:
        """Fetch a step's tokens and post-process them: appends, stops, frees (its outputs are
        made by the step() that calls this)."""
        e = self.engine
        result = e.runner.fetch(d.handle) if d.on_device else d.handle
        if d.prefill:
            tokens = sum(c.num_tokens for c in d.chunks)
            e.scheduler.cost_model.observe_prefill(time.perf_counter() - d.start, tokens)
        self._retreat(d)
        chunks, result = self._live(d, result)
        with e.profile.phase("update"):
            update = e.scheduler.update_from_output(chunks, result) if chunks else None
            for request_id, error in update.failed.items() if update else ():
                e._fail(e.requests[request_id], error)
            for group, seq in update.new_tokens if update else ():
                req = e.requests[group.request_id]
                try:
                    if req.error is None and (why := e.output_processor.check_stop(req, seq)):
                        e.scheduler.finish_seq(seq, why)
                except Exception as err:
                    e._fail(req, err)
        self._touched |= {c.group.request_id for c in chunks}

    def _live(self, d: Dispatched, result):
        """The chunks still to account for and their rows of ``result``: a sequence finished or
        aborted since the step was dispatched (it was scheduled ahead) drops its row."""
        e = self.engine
        live = [
            i
            for i, c in enumerate(d.chunks)
            if not c.seq.is_finished()
            and (req := e.requests.get(c.group.request_id)) is not None
            and req.error is None
        ]
        if len(live) == len(d.chunks):
            return d.chunks, result
        starts = np.cumsum([0, *d.num_rows])
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in live] or [[]])
        rows = rows.astype(np.int64)
        return [d.chunks[i] for i in live], jax.tree.map(lambda x: x[rows], result)

    # ---- advancing a step in flight -----------------------------------------------------------

    def _may_defer(self, d: Dispatched) -> bool:
        """Whether every request in the step is plain sampling (see the module doc)."""
        e = self.engine
        for c, n in zip(d.chunks, d.num_rows, strict=True):
            req = e.requests.get(c.group.request_id)
            if req is None or n > 1 or not isinstance(req.params, SamplingParams):
                return False
            p = req.params
            if p.uses_penalties or req.grammar is not None or req.prompt_logprobs is not None:
                return False
        return True

    def _can_schedule_ahead(self) -> bool:
        """Whether the next schedule cannot preempt, swap or re-prefill: a sequence with a
        placeholder must stay where it is until its token arrives."""
        s = self.engine.scheduler
        if s.swapped or getattr(s, "longrope_switch_len", None) is not None:
            return False
        if getattr(s.bm, "sliding_window", None) is not None:  # prompt chunks take blocks too
            return False
        running = sum(g.num_seqs(SequenceStatus.RUNNING) for g in s.running)
        return running <= s.bm.get_num_free_blocks()  # one slot each: at most a block each

    def _advance(self, d: Dispatched) -> None:
        """Account a dispatched step as computed, with a placeholder for each sampled token."""
        bm, row = self.engine.block_manager, 0
        for c, n in zip(d.chunks, d.num_rows, strict=True):
            if c.seq.is_finished():  # finished by the step before: its row is dropped
                row += n
                continue
            c.seq.num_computed_tokens += c.num_tokens
            bm.mark_blocks_computed(c.seq)
            if n:  # in the tokens the scheduler and the step read, not yet in the output
                c.seq.token_ids.append(placeholder(row))
            d.advanced.append((c, bool(n)))
            row += n

    def _retreat(self, d: Dispatched) -> None:
        """Undo ``_advance`` (update_from_output then accounts the step with its real tokens)."""
        for c, has_placeholder in d.advanced:
            c.seq.num_computed_tokens -= c.num_tokens
            if has_placeholder:
                c.seq.token_ids.pop()
        d.advanced.clear()
