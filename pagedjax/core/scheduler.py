"""FCFS continuous batching: a token budget per step, chunked prefill, preemption.

Pure Python; imports no jax. Each step the scheduler decides, on the host, which sequences compute
how many tokens, and which blocks the runner must swap or copy first. Order of service:
running groups (oldest first; the latest-arrived are preempted when blocks run out), then swapped
groups (resumed before any new request), then waiting groups, first come first served (with
LoRA, a group whose adapter would exceed the batch's slots waits: core/lora_admission.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Collection

from pagedjax.config import SchedulerConfig
from pagedjax.core import beam_search
from pagedjax.core.block_manager import AllocStatus, BlockManager
from pagedjax.core.in_flight import InFlight
from pagedjax.core.longrope import LongRopeSwitch
from pagedjax.core.lora_admission import LoRAAdmission
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus, append_sampled
from pagedjax.sampling_params import BeamSearchParams, SamplingParams

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


@dataclasses.dataclass
class SeqChunk:
    """``num_tokens`` tokens of ``seq`` computed this step, from ``seq.num_computed_tokens`` on."""

    group: SequenceGroup
    seq: Sequence
    num_tokens: int
    # Proposals verified after the seq's own tokens (in num_tokens; see pagedjax.spec_decode)
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    lora_slot: int = 0  # the device slot of its group's LoRA adapter (0: none), set by schedule

    @property
    def completes(self) -> bool:
        """Whether the step brings the sequence up to date, so its logits yield a new token."""
        num_own = self.num_tokens - len(self.spec_token_ids)
        return self.seq.num_computed_tokens + num_own == self.seq.get_len()

    @property
    def num_samples(self) -> int:
        """Tokens sampled from this chunk's last logits: none before the prompt is done, n (or
        best_of) for the first tokens of a parallel-sampling request (its samples fork then),
        else one."""
        if not self.completes:
            return 0
        p = self.group.sampling_params
        first = self.group.num_seqs() == 1 and self.seq.get_output_len() == 0
        return p.max_num_seqs if first and isinstance(p, SamplingParams) else 1


@dataclasses.dataclass
class StepUpdate:
    """What update_from_output did: sequences that got a token, requests whose update failed."""

    new_tokens: list[tuple[SequenceGroup, Sequence]] = dataclasses.field(default_factory=list)
    failed: dict[str, Exception] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list[SeqChunk] = dataclasses.field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[SequenceGroup] = dataclasses.field(default_factory=list)
    aborted: list[SequenceGroup] = dataclasses.field(default_factory=list)  # could not be kept

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class PreemptionCostModel:
    """Estimates, from measured step times, whether swapping a group out and back in costs less
    than recomputing its tokens (the paper's section 7.3). Until both are measured: recompute."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds_per_token: float | None = None  # prefill compute
        self.seconds_per_block: float | None = None  # one block moved one way

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self.seconds_per_token = self._ema(self.seconds_per_token, seconds / num_tokens)

    def observe_swap(self, seconds: float, num_blocks: int) -> None:
        if num_blocks:
            self.seconds_per_block = self._ema(self.seconds_per_block, seconds / num_blocks)

    def prefer_swap(self, num_tokens: int, num_blocks: int) -> bool:
        if self.seconds_per_token is None or self.seconds_per_block is None:
            return False
        return 2 * num_blocks * self.seconds_per_block < num_tokens * self.seconds_per_token


class Scheduler:
    """``config``: the engine's limits and preemption mode (pagedjax/config.py, checked there)."""

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
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: list[SequenceGroup] = []
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
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
        budget = self._schedule_running(out, self.token_budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        self.running.sort(key=lambda g: g.arrival_time)
        self.lora.assign_slots(out.chunks)
        return out

    def _num_running_seqs(self) -> int:
        return sum(_max_seqs(g) for g in self.running)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first (one token each, after securing a slot), then prompt chunks."""
        queue = sorted(self.running, key=lambda g: g.arrival_time)
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

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            status = self.bm.can_swap_in(group)
            if status is AllocStatus.NEVER:  # admission rules this out; never wait on it
                self.swapped.popleft()
                self._abort(group, out, "its swapped-out blocks no longer fit the device pool")
                continue
            if status is AllocStatus.LATER or budget < len(seqs):
                break
            if self._num_running_seqs() + _max_seqs(group) > self.max_num_seqs:
                break
            if self.lora.should_wait(group, self.running, []):
                break
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
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[SequenceGroup] = []  # waiting for an adapter slot; later ones may go
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if self._num_running_seqs() + _max_seqs(group) > self.max_num_seqs:
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
            self.bm.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            n = min(seq.get_len() - seq.num_computed_tokens, budget, self.bm.max_chunk_tokens)
            out.chunks.append(SeqChunk(group, seq, n))
            budget -= n
            self.running.append(group)
        self.waiting.extendleft(reversed(skipped))

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

    # ---- LongRoPE's switch (core/longrope.py) ----------------------------------------------------

    def _recompute(self, group: SequenceGroup) -> None:
        """Free the group's one sequence and queue it first, to be prefilled anew."""
        seq = group.get_seqs(SequenceStatus.RUNNING)[0]
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.longrope_recomputed = True
        self.waiting.appendleft(group)
        self.num_longrope_recomputes += 1

    # ---- preemption -----------------------------------------------------------------------

    def _can_preempt(self, group: SequenceGroup) -> bool:
        """A single sequence can always be recomputed; several can only be swapped out."""
        return group.num_seqs(SequenceStatus.RUNNING) == 1 or self.bm.can_swap_out(group)

    def _pick_victim(self, queue: list[SequenceGroup], group: SequenceGroup) -> SequenceGroup:
        """The latest-arrived group that can be preempted without losing it: from the groups not
        yet served this step (queue, oldest first), else ``group`` itself. Only when none can is
        one lost (the latest)."""
        for i in range(len(queue) - 1, -1, -1):
            if self._can_preempt(queue[i]):
                return queue.pop(i)
        if self._can_preempt(group) or not queue:
            return group
        return queue.pop()

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

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """All of the group's blocks at once: by recompute (a single sequence only, as in vLLM)
        or by swap. A group that can neither be swapped nor recomputed is aborted."""
        self.num_preemptions += 1
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        out.preempted.append(group)
        can_recompute = len(seqs) == 1
        mode = self.preemption_mode
        if mode == "auto":
            tokens = sum(s.get_len() for s in seqs)
            blocks = sum(len(self.bm.get_block_table(s)) - self.bm.num_released(s) for s in seqs)
            mode = "swap" if self.cost_model.prefer_swap(tokens, blocks) else "recompute"
        if mode == "swap" or not can_recompute:
            if self.bm.can_swap_out(group):
                out.blocks_to_swap_out += self.bm.swap_out(group)
                for seq in seqs:
                    seq.status = SequenceStatus.SWAPPED
                self.swapped.append(group)
                self.num_swapped += 1
                return
            if not can_recompute:
                out.preempted.remove(group)
                self._abort(
                    group,
                    out,
                    f"it had to be preempted and its {len(seqs)} sequences, which cannot be "
                    f"recomputed, found no free swap space ({self.bm.get_num_free_host_blocks()} "
                    f"host blocks free); raise swap_space_gib",
                )
                return
        for seq in seqs:
            self.bm.free(seq)
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = 0
        self.waiting.appendleft(group)


def _max_seqs(group: SequenceGroup) -> int:
    """Sequences the group will run at once (n samples or beams appear after the prompt)."""
    width = getattr(group.sampling_params, "max_num_seqs", 1)
    return max(width, group.num_seqs(SequenceStatus.RUNNING), 1)
