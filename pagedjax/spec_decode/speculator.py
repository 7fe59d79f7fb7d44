"""The host side of speculation: proposals into the schedule, verified tokens into the sequences.

Pure Python (numpy in the proposer); imports no jax. The scheduler calls ``add_drafts`` once it
has planned the step's decodes (one token each, its slot secured), and ``append_verified`` when it
accounts for a chunk that carried proposals.

Lookahead: a sequence of L tokens with p proposals computes p + 1 tokens this step, its last
token and the proposals, at positions L - 1 .. L + p - 1; their K/V go to slots the block manager
gives past the sequence's end (``append_lookahead_slots``, from spare blocks above the watermark
only: speculation never preempts anyone, it proposes less). Row j of the step's logits predicts
position L + j.

Rollback: row j's token is the proposal when the target accepted it, else the target's own
(a correction, or after the last proposal a bonus); tokens are appended one at a time, each
checked for stops (EOS, stop token ids, max_tokens, model length, then the engine's stop strings)
before the next, up to the first rejection. The K/V of the accepted proposals stays; the slots of
rejected ones are given back (``trim_slots`` frees the blocks past the computed tokens and
shortens the last one) and are overwritten when the sequence grows again. No block holding a
rejected token is ever full of computed tokens, so none reaches the prefix cache: blocks are
marked computed only up to the accepted length.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

from pagedjax.core.scheduler import SeqChunk, check_stop
from pagedjax.core.sequence import Sequence, SequenceGroup, append_sampled
from pagedjax.sampling_params import SamplingParams
from pagedjax.spec_decode.config import SpeculativeConfig
from pagedjax.spec_decode.metrics import SpecDecodingStats
from pagedjax.spec_decode.ngram import NgramProposer

# (group, seq) -> why seq stops after its last token ("stop"), or None: it goes on
StopChecker = Callable[[SequenceGroup, Sequence], str | None]


class PlaceholderProposer:
    """The proposer when a draft model proposes: it reserves the slots (k tokens whenever
    allowed), and spec_decode.draft.DraftModelRunner writes the drafts over these placeholders
    before the step runs."""

    def propose(self, token_ids, k: int) -> list[int]:
        return [0] * k


def with_proposals(chunk: SeqChunk, rows: list) -> tuple[list[int], list]:
    """A chunk's tokens to compute (the sequence's, then its proposals) and sampler rows: as
    given, or for p proposals p + 1 copies of its one row, row j sampling position + j with the
    proposals before it in its output history (for penalties)."""
    seq, drafts = chunk.seq, chunk.spec_token_ids
    start = seq.num_computed_tokens
    ids = seq.get_token_ids()[start : start + chunk.num_tokens - len(drafts)] + drafts
    if not drafts:
        return ids, rows
    (row,) = rows
    penalised = row.repetition_penalty != 1 or row.presence_penalty or row.frequency_penalty
    return ids, [
        dataclasses.replace(
            row,
            position=row.position + j,
            output_token_ids=[*row.output_token_ids, *drafts[:j]] if penalised else (),
        )
        for j in range(len(drafts) + 1)
    ]


class Speculator:
    """Proposes tokens for decoding sequences and takes the verified ones; keeps the counts.

    ``stop_checker(group, seq)`` (the engine's stop-string and grammar check, None in bare
    scheduler use) runs after each appended token, as the engine runs it after a plain decode's.
    """

    def __init__(self, config: SpeculativeConfig, stop_checker: StopChecker | None = None):
        self.config = config
        self.k = config.num_speculative_tokens
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:  # a draft model writes its proposals over these in the runner (draft.py)
            self.proposer = PlaceholderProposer()
        self.stop_checker = stop_checker
        self.stats = SpecDecodingStats()
        self._per_request: weakref.WeakKeyDictionary[SequenceGroup, SpecDecodingStats] = (
            weakref.WeakKeyDictionary()
        )

    def __reduce__(self):
        # An engine snapshot pickles its scheduler: the speculator (engine hooks, live counts)
        # stays with the engine, which hands it to a restored scheduler on its next step.
        return _none, ()

    @staticmethod
    def eligible(params) -> bool:
        """Beam search and structured output go one token at a time."""
        return isinstance(params, SamplingParams) and params.structured_outputs is None

    def add_drafts(self, sched, chunks: list[SeqChunk], budget: int) -> int:
        """Give each decode chunk (oldest request first) the proposals that fit the token
        budget, the model's length, the request's max_tokens, LongRoPE's switch and the spare
        blocks; returns the budget left."""
        for c in chunks:
            if budget <= 0:
                break
            seq, p = c.seq, c.group.sampling_params
            # Decodes only: not a prompt's last token (its first sample(s), its prompt logprobs).
            if c.num_tokens != 1 or c.num_samples != 1 or not seq.get_output_len():
                continue
            if not self.eligible(p):
                continue
            if p.masks_early_stops and seq.get_output_len() < p.min_tokens:  # stops masked
                continue
            # Past these a proposal could never be emitted: the last token comes from the target.
            limit = min(
                self.k,
                budget,
                sched.max_model_len - seq.get_len(),
                p.max_tokens - seq.get_output_len() - 1,
                _room_before_switch(sched.longrope_switch_len, seq),
            )
            drafts = self.proposer.propose(seq.get_token_ids(), limit) if limit > 0 else []
            n = sched.bm.append_lookahead_slots(seq, len(drafts)) if drafts else 0
            if n:
                c.spec_token_ids = drafts[:n]
                c.num_tokens += n
                budget -= n
        return budget

    def append_verified(self, sched, c: SeqChunk, result, rows: range, update) -> None:
        """Append the tokens the step verified for chunk c (sampler rows ``rows``: one per
        proposal, then the bonus row), up to the first rejection or stop; roll the rest back."""
        seq, group, p = c.seq, c.group, c.group.sampling_params
        num_drafts = len(c.spec_token_ids)
        num_accepted = 0
        while num_accepted < num_drafts and result.accepted[rows[num_accepted]]:
            num_accepted += 1
        self.stats.observe(num_drafts, num_accepted)
        mine = self._per_request.get(group)
        if mine is None:
            mine = self._per_request[group] = SpecDecodingStats()
        mine.observe(num_drafts, num_accepted)
        start = seq.num_computed_tokens  # position of the last token, whose K/V this step wrote
        for j, row in enumerate(rows):
            append_sampled(seq, p, result, row)
            sched.num_generation_tokens += 1
            # Tokens with K/V: the last one, and the accepted proposals among those appended.
            computed = start + 1 + min(j + 1, num_accepted)
            why = check_stop(seq, p, sched.eos_token_ids, sched.max_model_len)
            if why is not None:
                self._settle(sched, seq, computed)
                sched.finish_seq(seq, why)
            if self.stop_checker is not None and (why := self.stop_checker(group, seq)):
                if not seq.is_finished():
                    self._settle(sched, seq, computed)
                sched.finish_seq(seq, why)
            if seq.is_finished():
                break
            if j == num_accepted:  # the correction or the bonus: the last token of the step
                self._settle(sched, seq, computed)
                break
        if self.stop_checker is None:
            update.new_tokens.append((group, seq))

    @staticmethod
    def _settle(sched, seq: Sequence, num_computed: int) -> None:
        """Keep the K/V of seq's first num_computed tokens, give back the rest of its slots, and
        offer its full computed blocks to the prefix cache."""
        seq.num_computed_tokens = num_computed
        sched.bm.trim_slots(seq, num_computed)
        sched.bm.mark_blocks_computed(seq)

    def request_stats(self, group: SequenceGroup) -> SpecDecodingStats:
        """The counts of one request (zeros if it never proposed)."""
        mine = self._per_request.get(group)
        return mine.copy() if mine is not None else SpecDecodingStats()


def _room_before_switch(switch: int | None, seq: Sequence) -> int:
    """Proposals that keep the step's context within LongRoPE's switch while seq is short of
    it: a step reaching past the switch is rotated with the long factors throughout, and the
    scheduler's re-run (core/scheduler.py) must see the sequence cross it one token at a time."""
    if switch is None or seq.get_len() > switch:
        return 2**62
    return switch - seq.get_len()


def _none() -> None:
    return None


def stop_checker(output_processor, requests: dict) -> StopChecker:
    """The engine's stop check after each appended token (stop strings, grammars): its output
    processor's ``check_stop`` on the group's request, looked up in ``requests`` (the engine's
    request table, by id)."""

    def check(group: SequenceGroup, seq: Sequence) -> str | None:
        return output_processor.check_stop(requests[group.request_id], seq)

    return check


def make_speculator(
    config: SpeculativeConfig | None, stop_checker: StopChecker | None = None
) -> Speculator | None:
    """The engine's speculator (None without a speculative_config); ``stop_checker`` runs after
    each appended token."""
    if config is None:
        return None
    return Speculator(config, stop_checker)
