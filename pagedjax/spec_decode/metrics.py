"""Speculation counters, per request and for the whole engine (vLLM's names; pure Python)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodingStats:
    """What verification did. A draft is one sequence's proposals checked in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0  # proposed tokens verified
    num_accepted_tokens: int = 0  # of those, accepted (the leading ones the target agreed with)
    # accepted[i]: drafts whose proposal i was accepted (grows with the longest proposal seen)
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a draft's step yields on average: its accepted tokens plus the target's own
        (vLLM's "mean acceptance length"; 1 when nothing is accepted, 0 before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def copy(self) -> SpecDecodingStats:
        return dataclasses.replace(
            self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos)
        )
