"""LongRoPE's switch (Phi-3) in the schedule: which sequences are re-run or wait for room.

Pure Python; imports no jax. The model rotates a sequence's tokens with the long factors when its
context in the step is past the switch (models/config.py ``longrope_switch_len``), else with the
short ones. HF's generate re-runs the whole sequence with the long factors at the step whose input
reaches switch + 1 tokens with at most switch cached (Phi3ForCausalLM
.prepare_inputs_for_generation); the scheduler does the same, once per sequence. So that this
holds under any schedule: the first step of a prompt past the switch covers more than the switch
(a token budget that cannot is refused), and speculation never carries a step across it
(spec_decode/speculator.py).
"""

from __future__ import annotations

from pagedjax.core.block_manager import BlockManager
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus


class LongRopeSwitch:
    """The scheduler's view of the switch: ``switch`` tokens (None: no LongRoPE)."""

    def __init__(self, bm: BlockManager, token_budget: int, max_model_len: int):
        self.switch = bm.rope_switch_len
        self.bm, self.token_budget = bm, token_budget
        if self.switch is not None and max_model_len > self.switch:
            self._check_budget()

    def _check_budget(self) -> None:
        """A sequence re-run as it crosses the switch, or a prompt past it, must fit its first
        step past the switch: a step holds more tokens than the switch, or nothing could."""
        switch, budget = self.switch, self.token_budget
        if budget <= switch:
            raise ValueError(
                f"max_num_batched_tokens={budget} must exceed the model's original context of "
                f"{switch} tokens (LongRoPE's switch: a sequence growing past it is re-run with "
                f"the long factors in one step); raise max_num_batched_tokens above {switch} or "
                f"set max_model_len <= {switch}"
            )
        if self.bm.max_chunk_tokens <= switch:
            raise ValueError(
                f"the sliding window's chunk limit of {self.bm.max_chunk_tokens} tokens (from "
                f"num_blocks) must exceed the model's original context of {switch} tokens "
                f"(LongRoPE's switch); raise num_blocks or set max_model_len <= {switch}"
            )

    def crosses(self, group: SequenceGroup) -> bool:
        """Whether group's sequence is about to grow past the switch with its earlier KV
        computed with the short factors: it is re-run. Once per sequence; a group of several
        sequences (n > 1, beams) keeps its KV."""
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if self.switch is None or len(seqs) != 1 or seqs[0].longrope_recomputed:
            return False
        seq = seqs[0]
        return self.one_step(seq) and 0 < seq.num_computed_tokens <= self.switch

    def one_step(self, seq: Sequence) -> bool:
        """Whether seq is past the switch and its prefill fits one step, and so is prefilled
        in one (waiting for the budget if need be), as HF runs a prompt: all with the long
        factors. A longer one is chunked, its first chunk longer than the switch
        (``short_first_chunk``), so every chunk runs past the switch too."""
        limit = min(self.token_budget, self.bm.max_chunk_tokens)
        return self.switch is not None and self.switch < seq.get_len() <= limit

    def short_first_chunk(self, seq: Sequence, budget: int) -> bool:
        """Whether a waiting seq past the switch, chunked, would get a first chunk within the
        switch (rotated with the short factors) from ``budget`` tokens: it waits for room."""
        return self.switch is not None and seq.get_len() > self.switch and budget <= self.switch
