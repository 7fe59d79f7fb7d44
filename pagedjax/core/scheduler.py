"""Continuous batching: a token budget per step, chunked prefill, preemption.

Pure Python; imports no jax. Each step the scheduler decides, on the host, which sequences compute
how many tokens, and which blocks the runner must swap or copy first. Order of service:
running groups first (the last of them in the policy's order are preempted when blocks run out),
then swapped groups (resumed before any new request), then waiting groups (with LoRA, a group
whose adapter would exceed the batch's slots waits: core/lora_admission.py).

The policy (``--scheduling-policy``, core/request_queue.py) orders every queue: ``fcfs`` by
arrival; ``priority`` by (priority, arrival), where a running group of lower priority is also
preempted to admit a waiting one that outranks it, and a waiting group that outranks the first
swapped one is admitted before it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection

from pagedjax.config import SchedulerConfig
from pagedjax.core import beam_search
from pagedjax.core.block_manager import AllocStatus, BlockManager
from pagedjax.core.in_flight import InFlight
from pagedjax.core.longrope import LongRopeSwitch
from pagedjax.core.lora_admission import LoRAAdmission
from pagedjax.core.preemption import Preemption, max_seqs
from pagedjax.core.preemption_cost import PreemptionCostModel
from pagedjax.core.request_queue import new_queue, priority_key, running_order
from pagedjax.core.scheduler_output import SchedulerOutput, SeqChunk, StepUpdate
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus, append_sampled
from pagedjax.sampling_params import BeamSearchParams, SamplingParams

__all__ = [  # the step's types live in scheduler_output.py; importers may take them from here
    "PreemptionCostModel",
    "Scheduler",
    "SchedulerOutput",
    "SeqChunk",
    "StepUpdate",
    "check_stop",
]

_FINISHED_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH_CAPPED,
    "abort": SequenceStatus.FINISHED_ABORTED,
}


def check_stop(
    seq: Sequence, p: SamplingParams, eos_token_ids: Collection[int], max_model_len: int
) -> str | None:
    """Why seq stops after its last token: "stop" (EOS, a stop token id), "length", or None. A
    stop token id that is not an EOS it stops on is recorded as ``seq.stop_reason`` (vLLM's).
    (Stop strings need the text: the output processor checks them.)"""
    token = seq.get_last_token_id()
    eos = not p.ignore_eos and token in eos_token_ids
    early = seq.get_output_len() < getattr(p, "min_tokens", 0)  # no stop before (vLLM's)
    if (eos or token in p.stop_token_ids) and not early:
        seq.stop_reason = None if eos else token
        return "stop"
    if seq.get_output_len() >= p.max_tokens or seq.get_len() >= max_model_len:
        return "length"
    return None


class Scheduler(Preemption):
    """``config``: the engine's limits, preemption mode and policy (pagedjax/config.py, checked
    there)."""

    def __init__(
        self,
        block_manager: BlockManager,
        config: SchedulerConfig,
        *,
        eos_token_ids: Collection[int] = (),
        speculator=None,  # proposes tokens and takes the verified ones (pagedjax.spec_decode)
        lora: LoRAAdmission | None = None,  # admission by LoRA adapter slots
    ):
        budget, max_model_len = config.token_budget, config.max_model_len
        self.policy = policy = config.policy  # the order of service (core/request_queue.py)
        self._order = running_order(policy)
        self.bm = block_manager
        block_manager.limit_chunk_tokens(budget)  # a windowed table's run-ahead
        # LongRoPE (models/config.py ModelConfig.longrope_switch_len), as the block manager keys
        # its prefix cache by it
        self.longrope = LongRopeSwitch(block_manager, budget, max_model_len)
        self.longrope_switch_len = self.longrope.switch
        self.num_longrope_recomputes = 0
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = budget
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.preemption_mode = config.preemption_mode
        self.cost_model = PreemptionCostModel()
        self.waiting = new_queue(policy)  # a deque (fcfs) or a PriorityQueue, served from [0]
        self.running: list[SequenceGroup] = []
        self.swapped = new_queue(policy)
        self.num_preemptions = 0
        self.num_swapped = 0
        self.num_aborted = 0  # groups the scheduler gave up on (with a reason)
        self.num_generation_tokens = 0  # output tokens appended (and beam tokens), ever
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculator = speculator
        self.lora = lora or LoRAAdmission()
        self._seq_ids = itertools.count()
        self.in_flight = InFlight(self)  # async scheduling's account of a step in flight

    # ---- requests -------------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is and free its blocks; None if it is not here."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self._end_group(group)
                    return group
        return None

    def free_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        if self.bm.has_blocks(seq):
            self.bm.free(seq)
        if not seq.is_finished():
            seq.status = status

    def drop_finished(self) -> None:
        self.running = [g for g in self.running if not g.is_finished()]

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.policy == "priority":
            self._preempt_for_waiting(out)
        made_room = len(out.preempted)
        budget = self._schedule_running(out, self.token_budget)
        if len(out.preempted) == made_room:  # no running group lacked blocks
            self._schedule_queued(out, budget)
        self.running.sort(key=self._order)
        self.lora.assign_slots(out.chunks)
        return out

    def _schedule_queued(self, out: SchedulerOutput, budget: int) -> None:
        """Swapped groups, then waiting ones. Under fcfs every swapped group resumes before any
        new one is admitted; under priority, whichever queue's first group ranks first is served,
        in turn, until one's first group cannot go."""
        if self.policy != "priority":
            budget, _ = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
            return
        yielded = True
        while yielded and (self.waiting or self.swapped) and budget > 0:
            w = priority_key(self.waiting[0]) if self.waiting else None
            s = priority_key(self.swapped[0]) if self.swapped else None
            if w is not None and (s is None or w < s):
                budget, yielded = self._schedule_waiting(out, budget, until=s)
            else:
                budget, yielded = self._schedule_swapped(out, budget, until=w)

    def _num_running_seqs(self) -> int:
        return sum(max_seqs(g) for g in self.running)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first (one token each, after securing a slot), then prompt chunks."""
        queue = sorted(self.running, key=self._order)
        if self.bm.sliding_window is not None:
            for group in queue:  # before any is preempted: only live blocks are swapped out
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    self.bm.release_outside_window(seq)  # blocks before the window
        kept, prefilling = [], []
        while queue:
            group = queue.pop(0)
            if self.longrope.crosses(group):
                self._recompute(group)
                continue
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            if len(seqs) == 1 and self.bm.append_decode_slot(seqs[0]):  # most decodes
                kept.append(group)
                out.chunks.append(SeqChunk(group, seqs[0], 1))
                budget -= 1
                continue
            while not self.bm.can_append_slots(group):
                victim = self._pick_victim(queue, group)
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                kept.append(group)
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    remaining = seq.get_len() - seq.num_computed_tokens
                    if remaining > 1:
                        if self.bm.sliding_window is not None:  # its table runs ahead by a chunk
                            out.blocks_to_copy += self.bm.append_slots(seq)
                        prefilling.append((group, seq, min(remaining, self.bm.max_chunk_tokens)))
                        continue
                    out.blocks_to_copy += self.bm.append_slots(seq)
                    out.chunks.append(SeqChunk(group, seq, 1))
                    budget -= 1
        if self.speculator is not None:  # proposals for the decodes, within budget and pool
            budget = self.speculator.add_drafts(self, out.chunks, budget)
        for group, seq, remaining in prefilling:
            n = min(remaining, max(budget, 0))
            if n:
                out.chunks.append(SeqChunk(group, seq, n))
                budget -= n
        self.running = kept
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, until=None) -> tuple[int, bool]:
        """Resume swapped groups in order (under priority, those ranked before ``until``); the
        budget left, and whether it stopped only for the other queue (or an empty one)."""
        while self.swapped:
            group = self.swapped[0]
            if until is not None and priority_key(group) > until:
                return budget, True
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            status = self.bm.can_swap_in(group)
            if status is AllocStatus.NEVER:  # admission rules this out; never wait on it
                self.swapped.popleft()
                self._abort(group, out, "its swapped-out blocks no longer fit the device pool")
                continue
            if status is AllocStatus.LATER or budget < len(seqs):
                return budget, False
            if self._num_running_seqs() + max_seqs(group) > self.max_num_seqs:
                return budget, False
            if self.lora.should_wait(group, self.running, []):
                return budget, False
            self.swapped.popleft()
            if (why := self.lora.activate(group, self.running)) is not None:
                self._abort(group, out, why)
                continue
            out.blocks_to_swap_in += self.bm.swap_in(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                out.blocks_to_copy += self.bm.append_slots(seq)
                n = min(seq.get_len() - seq.num_computed_tokens, max(budget, 1))
                n = min(n, self.bm.max_chunk_tokens)
                out.chunks.append(SeqChunk(group, seq, n))
                budget -= n
            self.running.append(group)
        return budget, True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, until=None) -> tuple[int, bool]:
        """Admit waiting groups in order (under priority, those ranked before ``until``); the
        budget left, and whether it stopped only for the other queue (or an empty one)."""
        skipped: list[SequenceGroup] = []  # waiting for an adapter slot; later ones may go
        yielded = False
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if until is not None and priority_key(group) > until:
                yielded = True
                break
            if self._num_running_seqs() + max_seqs(group) > self.max_num_seqs:
                break
            if self.lora.should_wait(group, self.running, skipped):
                skipped.append(self.waiting.popleft())
                continue
            status = self.bm.can_allocate(group)
            if status is AllocStatus.LATER:
                break
            self.waiting.popleft()
            if status is AllocStatus.NEVER:  # admission rules this out; never wait on it
                self._abort(group, out, "its prompt no longer fits the device pool")
                continue
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            one_step = not self.enable_chunked_prefill or self.longrope.one_step(seq)
            if (one_step and seq.get_len() > budget) or self.longrope.short_first_chunk(
                seq, budget
            ):
                self.waiting.appendleft(group)
                break
            if (why := self.lora.activate(group, self.running)) is not None:
                self._abort(group, out, why)
                continue
            if group.first_scheduled_time is None:
                group.first_scheduled_time = time.monotonic()
            self.bm.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            n = min(seq.get_len() - seq.num_computed_tokens, budget, self.bm.max_chunk_tokens)
            out.chunks.append(SeqChunk(group, seq, n))
            budget -= n
            self.running.append(group)
        yielded = yielded or not (self.waiting or skipped)
        self.waiting.extendleft(reversed(skipped))
        return budget, yielded

    # ---- after the step -------------------------------------------------------------------

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        """End seq ("stop", "length" or "abort") and free its blocks."""
        self.free_seq(seq, _FINISHED_STATUS[reason])
        seq.status = _FINISHED_STATUS[reason]
        seq.finish_reason = reason

    def fork(self, group: SequenceGroup, parent: Sequence, sample_index: int) -> Sequence:
        """A new sequence of group sharing every block of parent."""
        child = parent.fork(self.new_seq_id())
        child.sample_index = sample_index
        self.bm.fork(parent, child)
        group.add(child)
        return child

    def update_from_output(self, chunks: list[SeqChunk], result) -> StepUpdate:
        """Account for an executed step: the chunks' KV is in the pool; each completing chunk
        has ``num_samples`` rows of ``result`` (tokens, logprobs, top_token_ids, top_logprobs,
        host arrays), plus one per proposal, in chunk order. Appends tokens, forks the n samples
        and the kept beams, stops (EOS, stop token ids, length) and frees what finished. A
        request whose update raises is reported in ``failed`` and the others go on."""
        update = StepUpdate()
        row, beams = 0, {}
        for c in chunks:
            rows = range(row, row + c.num_samples + len(c.spec_token_ids))  # + 1 per proposal
            row = rows.stop
            group = c.group
            if group.request_id in update.failed:
                continue
            if not c.spec_token_ids:  # else the speculator advances it by what it accepts
                c.seq.num_computed_tokens += c.num_tokens
                self.bm.mark_blocks_computed(c.seq)
            if not rows:
                continue
            if isinstance(group.sampling_params, BeamSearchParams):
                top = (
                    result.top_token_ids[rows[0]].tolist(),
                    result.top_logprobs[rows[0]].tolist(),
                )
                beams.setdefault(group.request_id, (group, []))[1].append((c.seq, *top))
                continue
            try:
                if c.spec_token_ids:
                    self.speculator.append_verified(self, c, result, rows, update)
                    continue
                for i in rows[1:]:  # the first tokens of n samples
                    self._append(group, self.fork(group, c.seq, i - rows[0]), result, i, update)
                self._append(group, c.seq, result, rows[0], update)
            except Exception as e:
                update.failed[group.request_id] = e
        for group, candidates in beams.values():
            try:
                self._beam_update(group, candidates)
            except Exception as e:
                update.failed[group.request_id] = e
        return update

    def _append(self, group, seq: Sequence, result, row: int, update: StepUpdate) -> None:
        p: SamplingParams = group.sampling_params
        append_sampled(seq, p, result, row)
        self.num_generation_tokens += 1
        reason = check_stop(seq, p, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.finish_seq(seq, reason)
        update.new_tokens.append((group, seq))

    def _beam_update(self, group: SequenceGroup, candidates) -> None:
        p: BeamSearchParams = group.sampling_params
        step = beam_search.beam_step(
            p, candidates, group.finished_beams, self.eos_token_ids, self.max_model_len
        )
        group.finished_beams += step.finished
        for seq in step.drop:
            self.free_seq(seq, SequenceStatus.FINISHED_ABORTED)
            del group.seqs_dict[seq.seq_id]
        for seq, _, _ in candidates:
            picks = step.extend.get(seq.seq_id)
            if picks:
                for token, lp in picks[1:]:
                    self.fork(group, seq, 0).append_token_id(token, lp)
                seq.append_token_id(*picks[0])
                self.num_generation_tokens += len(picks)
        if step.done:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                group.finished_beams.append((list(seq.output_token_ids), seq.cumulative_logprob))
                self.finish_seq(seq, "length")

    def _end_group(self, group: SequenceGroup) -> None:
        """Abort every unfinished seq of group (a finished one keeps its finish reason)."""
        for seq in group.get_seqs():
            if seq.is_finished():
                self.free_seq(seq, seq.status)
            else:
                self.finish_seq(seq, "abort")

    def _abort(self, group: SequenceGroup, out: SchedulerOutput, reason: str) -> None:
        self._end_group(group)
        group.abort_reason = reason
        out.aborted.append(group)
        self.num_aborted += 1
