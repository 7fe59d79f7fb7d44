"""Sequence (one stream of tokens) and SequenceGroup (one request: its samples or beams).

Pure Python; imports no jax.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from pagedjax.utils import cdiv

if TYPE_CHECKING:
    from pagedjax.lora.request import LoRARequest
    from pagedjax.sampling_params import BeamSearchParams, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def __init__(self, *_):
        # A plain attribute: read for every sequence several times a step, where a set lookup
        # would call Enum's Python-level __hash__.
        self.finished = self._name_.startswith("FINISHED_")

    def is_finished(self) -> bool:
        return self.finished


class Sequence:
    """Token state of one sequence. Its KV blocks live in the BlockManager, keyed by seq_id.

    num_computed_tokens counts the leading tokens whose KV is in the pool; the engine advances it
    after each step (BlockManager.allocate sets it to the prefix-cache hit length).
    extra_hash_key (e.g. a per-tenant salt) is mixed into every prefix-cache block hash, so
    sequences with different keys never share cached blocks; so is lora_int_id (the LoRA adapter
    its KV is computed under, 0 for the base model).
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Iterable[int],
        block_size: int,
        extra_hash_key: Hashable = None,
        lora_int_id: int = 0,
    ):
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id}: prompt_token_ids must not be empty")
        if block_size < 1:
            raise ValueError(f"sequence {seq_id}: block_size must be >= 1, got {block_size}")
        self.seq_id = seq_id
        self.block_size = block_size
        self.extra_hash_key = extra_hash_key
        self.lora_int_id = lora_int_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output, kept whole for O(1) slicing
        self.cumulative_logprob = 0.0
        self.num_computed_tokens = 0
        self.longrope_recomputed = False  # re-prefilled once past LongRoPE's switch (scheduler)
        self.status = SequenceStatus.WAITING
        # Output state, kept by the engine.
        self.sample_index = 0  # which of the request's n samples this is
        self.text = ""  # detokenized output, cut at a stop string
        self.prefix_offset = max(len(prompt_token_ids) - 5, 0)  # detokenizer window start
        self.read_offset = len(prompt_token_ids)  # tokens before this are in ``text``
        self.stop_search_from = 0  # stop strings can only start in text[stop_search_from - L:]
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop token id or stop string that finished it, else None
        self.stop_reason: int | str | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
            f"len={self.get_len()}, num_computed_tokens={self.num_computed_tokens})"
        )

    def append_token_id(self, token_id: int, logprob: float = 0.0) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self.token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.token_ids

    def get_last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed to hold every token."""
        return cdiv(self.get_len(), self.block_size)

    def is_finished(self) -> bool:
        return self.status.finished

    def fork(self, new_seq_id: int) -> Sequence:
        """A copy with its own token lists (the block tables are forked by the BlockManager)."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = new_seq_id
        child.output_token_ids = list(self.output_token_ids)
        child.token_ids = list(self.token_ids)
        child.logprobs = list(self.logprobs)
        return child


class SequenceGroup:
    """One request: the sequences (n samples or beams) generated from the same prompt."""

    def __init__(
        self,
        request_id: str,
        seqs: Iterable[Sequence],
        arrival_time: float,
        sampling_params: SamplingParams | BeamSearchParams | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.seqs_dict: dict[int, Sequence] = {}
        for seq in seqs:
            self.add(seq)
        if not self.seqs_dict:
            raise ValueError(f"request {request_id!r}: a sequence group needs at least one seq")
        self.arrival_time = arrival_time
        # The request's own copy, stored here only (Request.params reads it).
        self.sampling_params = sampling_params
        self.abort_reason: str | None = None  # why the engine gave up on it, if it did
        self.finished_beams: list[tuple[list[int], float]] = []  # beam search: (tokens, logprob)
        self.lora_request = lora_request  # the adapter it runs under (None: the base model)
        if lora_request is not None:  # its KV is the adapter's: so are its cached blocks
            for seq in self.seqs_dict.values():
                seq.lora_int_id = lora_request.lora_int_id
        self.num_lora_skips = 0  # times admission passed it over for want of an adapter slot
        self.priority = priority  # --scheduling-policy priority: lower is served first
        self.first_scheduled_time: float | None = None  # time.monotonic() when first admitted

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.get_seqs()})"

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs_dict:
            raise ValueError(f"request {self.request_id!r} already has seq_id {seq.seq_id}")
        self.seqs_dict[seq.seq_id] = seq

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs_dict.values())
        return [seq for seq in self.seqs_dict.values() if seq.status is status]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        if status is None:
            return len(self.seqs_dict)
        return sum(seq.status is status for seq in self.seqs_dict.values())

    def is_finished(self) -> bool:
        return all(seq.status.finished for seq in self.seqs_dict.values())


def append_sampled(seq: Sequence, p: SamplingParams, result, row: int) -> None:
    """Append row ``row`` of the sampler's ``result`` to seq, with the logprobs p asks for."""
    token, logprob = int(result.tokens[row]), float(result.logprobs[row])
    seq.append_token_id(token, logprob)
    if p.logprobs is not None:
        top = zip(
            result.top_token_ids[row, : p.logprobs].tolist(),
            result.top_logprobs[row, : p.logprobs].tolist(),
            strict=True,
        )
        seq.logprobs.append({token: logprob, **dict(top)})
