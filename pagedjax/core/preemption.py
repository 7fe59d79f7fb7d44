"""Preemption, mixed into the Scheduler (core/scheduler.py): which running group gives its
blocks back when they run out (the last in the policy's order), how (recompute or swap, by
``preemption_mode``), the priority policy's preemption of lower-priority running groups for a
waiting group that outranks them (vLLM's), and LongRoPE's re-prefill past its switch.

It works on the scheduler's own state: ``bm``, ``waiting``, ``running``, ``swapped``,
``preemption_mode``, ``cost_model``, ``max_num_seqs`` and its counters. Pure Python; imports no
jax.
"""

from __future__ import annotations

from pagedjax.core.block_manager import AllocStatus
from pagedjax.core.request_queue import priority_key
from pagedjax.core.scheduler_output import SchedulerOutput
from pagedjax.core.sequence import SequenceGroup, SequenceStatus


class Preemption:
    """The Scheduler's preemption methods (a mixin: Scheduler holds the state they use)."""

    def priority_inversion(self) -> bool:
        """Whether the first waiting group outranks a running one (priority policy): the next
        schedule may preempt for it."""
        if self.policy != "priority" or not self.waiting or not self.running:
            return False
        head = priority_key(self.waiting[0])
        return any(priority_key(g) > head for g in self.running)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """vLLM's priority preemption: while the first waiting group cannot be admitted (its
        blocks, or max_num_seqs), preempt the running group of the lowest priority among those
        it outranks (the latest-arrived among equals)."""
        if not self.waiting:
            return
        head = self.waiting[0]
        rank = priority_key(head)
        while True:
            status = self.bm.can_allocate(head)
            if status is AllocStatus.NEVER:  # it is aborted when its turn comes
                return
            seqs_fit = sum(max_seqs(g) for g in self.running) + max_seqs(head) <= self.max_num_seqs
            if status is AllocStatus.OK and seqs_fit:
                return
            victims = [g for g in self.running if priority_key(g) > rank and self._can_preempt(g)]
            if not victims:
                return
            victim = max(victims, key=priority_key)
            self.running.remove(victim)
            self._preempt(victim, out)

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
        """The last group in the policy's order (fcfs: the latest-arrived; priority: the lowest
        priority, then the latest-arrived) that can be preempted without losing it: from the
        groups not yet served this step (queue, in that order), else ``group`` itself. Only when
        none can is one lost (the last)."""
        for i in range(len(queue) - 1, -1, -1):
            if self._can_preempt(queue[i]):
                return queue.pop(i)
        if self._can_preempt(group) or not queue:
            return group
        return queue.pop()

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


def max_seqs(group: SequenceGroup) -> int:
    """Sequences the group will run at once (n samples or beams appear after the prompt)."""
    width = getattr(group.sampling_params, "max_num_seqs", 1)
    return max(width, group.num_seqs(SequenceStatus.RUNNING), 1)
