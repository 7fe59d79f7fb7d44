"""What the scheduler hands the engine each step and gets back: the chunks to compute with the
block moves before them (SchedulerOutput), and what applying a step's tokens did (StepUpdate).
Pure Python; imports no jax."""

from __future__ import annotations

import dataclasses

from pagedjax.core.sequence import Sequence, SequenceGroup
from pagedjax.sampling_params import SamplingParams


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
