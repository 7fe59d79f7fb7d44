"""A step in flight as the scheduler counts it (async scheduling; vLLM's AsyncScheduler keeps the
same account).

Once step N is dispatched, and before its tokens reach the host, the scheduler counts each of its
chunks as computed and each sequence that samples in it one placeholder token longer: id
``-1 - r`` for row r of N's sampler output, in ``seq.token_ids`` only (its output tokens, what
outputs read, stay the real ones; step N+1's sampling rows count ``seq.get_len()``, the
placeholder included, min_tokens' mask too: engine/request.py). Step N+1 is then scheduled
exactly as it would be after N, and the runner fills the placeholders on the device. Before N's
real tokens are applied (``Scheduler.update_from_output``) the account is undone. At most one
step is in flight.
"""

from __future__ import annotations

from pagedjax.core.sequence import SequenceStatus


def placeholder(row: int) -> int:
    """The token id that stands for row ``row`` of the previous step's sampled tokens."""
    if row < 0:
        raise ValueError(f"row must be >= 0, got {row}")
    return -1 - row


class InFlight:
    """The scheduler's account of the step in flight (``Scheduler.in_flight``)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler  # the Scheduler that holds this account (no import: a cycle)
        # (SeqChunk, whether it holds a placeholder) for each chunk counted ahead
        self.advanced: list[tuple[object, bool]] = []

    def can_schedule_ahead(self) -> bool:
        """Whether the next schedule cannot preempt, swap or re-prefill: a sequence with a
        placeholder must stay where it is until its token arrives."""
        s = self.scheduler
        if s.swapped or s.longrope_switch_len is not None or s.priority_inversion():
            return False
        if s.bm.sliding_window is not None:  # prompt chunks take blocks too
            return False
        running = sum(g.num_seqs(SequenceStatus.RUNNING) for g in s.running)
        return running <= s.bm.get_num_free_blocks()  # one slot each: at most a block each

    def advance(self, chunks: list, num_rows: list[int]) -> bool:
        """Count a dispatched step's SeqChunks as computed, with a placeholder for each sequence
        that samples (``num_rows``: its sampler rows per chunk, in order); whether anything was
        counted (a sequence finished meanwhile is skipped, its rows dropped)."""
        if self.advanced:
            raise RuntimeError("a step is in flight already: retreat it first")
        row = 0
        for c, n in zip(chunks, num_rows, strict=True):
            if not c.seq.is_finished():
                c.seq.num_computed_tokens += c.num_tokens
                self.scheduler.bm.mark_blocks_computed(c.seq)
                if n:
                    c.seq.token_ids.append(placeholder(row))
                self.advanced.append((c, bool(n)))
            row += n
        return bool(self.advanced)

    def retreat(self) -> None:
        """Undo ``advance`` (``update_from_output`` then counts the step with its real tokens)."""
        for c, has_placeholder in self.advanced:
            c.seq.num_computed_tokens -= c.num_tokens
            if has_placeholder:
                c.seq.token_ids.pop()
        self.advanced.clear()

    def drop(self) -> None:
        """Forget the step in flight without undoing it (its requests are dropped with it)."""
        self.advanced.clear()
