"""Host lists -> one padded ``StepInput``, and the set of shapes those can take.

Every size a model program depends on is padded to a bucket (tokens, sequences, block-table
width, longest query), so a long run compiles a bounded set of programs and ``warmup`` can
compile them all up front (``step_shapes``).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from pagedjax.models.step_input import StepInput
from pagedjax.utils import cdiv, next_pow2, powers_of_two
from pagedjax.worker.persistent_batch import PersistentBatch
from pagedjax.worker.prompt_logprobs import PromptRows
from pagedjax.worker.sampler import SamplingRow

# Smallest buckets: below these, padding is cheaper than another compiled program.
MIN_TOKENS_BUCKET = 32
MIN_SEQS_BUCKET = 8
MIN_CONTEXT_BUCKET = 256  # tokens of context covered by the smallest block-table bucket
# Where the attention kernels' work follows each sequence's context length rather than the
# table's width (GPU, TPU and the native CPU kernels), a wider table costs its transfer alone
# (4 bytes a block a sequence slot): widths start at this many tokens and grow 16-fold, one width
# up to an 8192-token context, three at 128K. XLA's reference path reads every entry of the
# table: there widths double from MIN_CONTEXT_BUCKET.
MIN_CONTEXT_BUCKET_FOLLOWING = 8192
WIDTH_GROWTH_FOLLOWING = 16
MIN_QUERY_BUCKET = 16


@dataclasses.dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    token_ids: list[int]  # tokens whose K/V this step computes and writes
    start_pos: int  # position of token_ids[0] (= tokens already in the pool)
    block_table: list[int]  # physical blocks covering positions 0 .. start_pos + len(token_ids)
    # Tokens to sample from this chunk's last logits: none for a prompt chunk that does not
    # finish the prompt, n for the first tokens of a parallel-sampling request.
    samples: list[SamplingRow] = dataclasses.field(default_factory=list)
    prompt_rows: PromptRows | None = None  # rows whose prompt logprobs a request asked for
    # Speculation: the last num_spec_tokens of token_ids are proposals, and ``samples`` has one
    # row per proposal then one more (the target's logits at each of the last 1 + p tokens).
    num_spec_tokens: int = 0
    # The sequence's id (core/sequence.py), when it has one: its block table then lives in a
    # persistent row across steps (worker/persistent_batch.py) and only its changes are written.
    seq_id: int | None = None
    # The device slot of the sequence's LoRA adapter (0: the base model; core/lora_admission.py).
    lora_slot: int = 0


def widest_seqs_bucket(max_num_seqs: int) -> int:
    """The widest sequence bucket a step of at most ``max_num_seqs`` sequences pads to."""
    return next_pow2(max_num_seqs, MIN_SEQS_BUCKET)


def seqs_bucket(n: int, decode: bool, widest: int) -> int:
    """The sequence slots (and logits rows) of a step of ``n``: powers of two in a decode step,
    the engine's hot path; powers of four in a step with prompt rows, whose extra slots cost
    their logits rows alone, so that prefill shapes number a few dozen. At most ``widest``."""
    if decode:
        return next_pow2(n, MIN_SEQS_BUCKET)
    b = MIN_SEQS_BUCKET
    while b < n:
        b *= 4
    return max(min(b, widest), n)


def seqs_buckets(max_n: int, decode: bool, widest: int) -> list[int]:
    """Every ``seqs_bucket`` of a step of 1 .. ``max_n`` sequences (or rows)."""
    out = [seqs_bucket(1, decode, widest)]
    while out[-1] < max_n:
        out.append(seqs_bucket(out[-1] + 1, decode, widest))
    return out


def query_bucket(n: int) -> int:
    """Coarse buckets (powers of eight from 16: 16, 128, 1024, 8192) for the longest query of a
    prefill step: the kernels' grids follow it, and their tiles past a sequence's rows return at
    once, so a coarse bound costs little and keeps prefill shapes few."""
    b = MIN_QUERY_BUCKET
    while b < n:
        b *= 8
    return b


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What picks a model program: the padded sizes of a ``StepInput``."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    max_query_len: int  # 1: a decode step (num_tokens == num_seqs)

    def __str__(self) -> str:
        kind = "decode" if self.max_query_len == 1 else f"prefill q{self.max_query_len}"
        return f"{kind} t{self.num_tokens} s{self.num_seqs} b{self.max_blocks}"


class InputBatcher:
    """Builds step inputs for one pool geometry (block size, longest sequence). In a step with a
    query longer than one token each sequence slot owns ``logits_per_seq`` logits rows (1 + the
    proposals an engine that speculates may verify per sequence); a decode step, which verifies
    nothing, one. The width follows the step's shape, so speculation adds no model programs."""

    def __init__(
        self,
        block_size: int,
        max_model_len: int,
        logits_per_seq: int = 1,
        *,
        follows_context: bool = False,
        max_num_seqs: int = 256,
    ):
        """``follows_context``: the attention kernels' work follows each sequence's context, not
        the table's width (coarse width buckets). ``max_num_seqs``: the engine's, which caps
        the sequence buckets."""
        self.block_size = block_size
        self.widest_seqs = widest_seqs_bucket(max_num_seqs)
        self.max_model_len = max_model_len
        self.logits_per_seq = logits_per_seq
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        min_context = MIN_CONTEXT_BUCKET_FOLLOWING if follows_context else MIN_CONTEXT_BUCKET
        self.min_blocks_bucket = min(self.max_blocks_per_seq, cdiv(min_context, block_size))
        self.width_growth = WIDTH_GROWTH_FOLLOWING if follows_context else 2
        # The shapes ``build`` has produced, in the order first seen (appended on the engine
        # thread; a background compile reads a copy to compile what the traffic needs next).
        self.shapes_built: list[StepShape] = []
        self._built: set[tuple[int, int, int, int]] = set()

    # The attention kernels size their grids by the longest query, so it is bucketed; the
    # reference attention's work follows the real rows whatever that bound, so the runner turns
    # query buckets off there and every prefill step takes the token bucket as its bound (a
    # fifth or fewer of the programs to compile).
    query_buckets = True
    # Whether steps carry each token row's LoRA slot (StepInput.lora_slot): an engine that serves
    # adapters; None in the steps of one that does not.
    lora = False

    def max_query_bucket(self, max_q: int, num_tokens_b: int) -> int:
        """The static bound on any sequence's query rows in a prefill step."""
        return min(query_bucket(max_q), num_tokens_b) if self.query_buckets else num_tokens_b

    def blocks_bucket(self, max_blocks: int) -> int:
        """The table width (blocks) of a step whose longest table has ``max_blocks``."""
        b = self.min_blocks_bucket
        while b < max_blocks:
            b *= self.width_growth
        return max(min(b, self.max_blocks_per_seq), max_blocks)

    def build(
        self, seqs: list[ScheduledSeq], table_rows: PersistentBatch | None = None
    ) -> StepInput:
        """Pack the sequences' tokens (numpy), padded to buckets. Sequence i owns rows
        ``i * F .. (i + 1) * F - 1`` of ``logits_indices`` (F = ``logits_per_step(decode)``), the
        first ``1 + num_spec_tokens`` of them its last tokens; there are at least as many of these
        rows as sample rows. ``table_rows``: block-table rows kept across steps, used when every
        sequence has a ``seq_id`` (the result is the same either way)."""
        # Whole-batch numpy: one pass over the sequences per list they hold, the rest is
        # vectorized (no numpy call per sequence).
        bs, num = self.block_size, len(seqs)
        q_lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, num)
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, num)
        widths = np.fromiter((len(s.block_table) for s in seqs), np.int64, num)
        num_tokens, max_q = int(q_lens.sum()), int(q_lens.max())
        num_rows = sum(len(s.samples) for s in seqs)
        decode = max_q == 1
        per_seq = self.logits_per_step(decode)
        num_seqs_b = seqs_bucket(max(num, cdiv(num_rows, per_seq)), decode, self.widest_seqs)
        num_tokens_b = num_seqs_b if decode else next_pow2(num_tokens, MIN_TOKENS_BUCKET)
        max_blocks_b = self.blocks_bucket(int(widths.max()))

        ends = np.cumsum(q_lens)  # each sequence's rows end here
        seq_of_row = np.repeat(np.arange(num), q_lens)
        pos = starts[seq_of_row] + np.arange(num_tokens) - (ends - q_lens)[seq_of_row]

        tables = np.zeros((num_seqs_b, max_blocks_b), np.int32)
        keys = [s.seq_id for s in seqs] if table_rows is not None else [None]
        persistent = None not in keys and len(set(keys)) == num
        if persistent and max_blocks_b <= table_rows.tables.shape[1]:
            rows = table_rows.rows_for(keys, [s.block_table for s in seqs])
            tables[:num] = table_rows.tables[rows, :max_blocks_b]
        else:
            tables[:num][np.arange(max_blocks_b) < widths[:, None]] = np.fromiter(
                itertools.chain.from_iterable(s.block_table for s in seqs), np.int32, widths.sum()
            )
        token_ids = np.zeros(num_tokens_b, np.int32)
        token_ids[:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in seqs), np.int32, num_tokens
        )
        positions = np.zeros(num_tokens_b, np.int32)
        positions[:num_tokens] = pos
        slots = np.full(num_tokens_b, -1, np.int32)
        slots[:num_tokens] = tables[seq_of_row, pos // bs] * bs + pos % bs
        context_lens = np.zeros(num_seqs_b, np.int32)
        context_lens[:num] = starts + q_lens
        # Decode layout keeps row i = sequence i, so padding sequences own the padding rows.
        if decode:
            qsl = np.arange(num_seqs_b + 1, dtype=np.int32)
        else:
            qsl = np.full(num_seqs_b + 1, num_tokens, np.int32)
            qsl[:num] = ends - q_lens
        logits_indices = np.zeros(num_seqs_b * per_seq, np.int32)
        if per_seq == 1:
            logits_indices[:num] = ends - 1
        else:
            n = 1 + np.fromiter((s.num_spec_tokens for s in seqs), np.int64, num)
            j = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)  # row within its sequence
            logits_indices[np.repeat(np.arange(num) * per_seq, n) + j] = np.repeat(ends - n, n) + j
        lora_slot = None
        if self.lora:  # padding rows: slot 0
            lora_slot = np.zeros(num_tokens_b, np.int32)
            lora_slot[:num_tokens] = np.repeat([s.lora_slot for s in seqs], q_lens)
        max_query_b = 1 if decode else self.max_query_bucket(max_q, num_tokens_b)
        if (shape := (num_tokens_b, num_seqs_b, max_blocks_b, max_query_b)) not in self._built:
            self._built.add(shape)
            self.shapes_built.append(StepShape(*shape))
        return StepInput(
            token_ids=token_ids,
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            context_lens=context_lens,
            query_start_loc=qsl,
            logits_indices=logits_indices,
            max_query_len=max_query_b,
            lora_slot=lora_slot,
        )

    def step_shapes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
        """Every shape ``build`` can produce for batches of at most ``max_num_seqs`` sequences
        (and sample rows) and ``max_num_batched_tokens`` tokens."""
        widest = widest_seqs_bucket(max_num_seqs)
        if widest > self.widest_seqs:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} exceeds the batcher's ({self.widest_seqs} slots)"
            )
        tables: dict[int, list[int]] = {}  # block bucket -> longest tables padded to it
        for m in range(1, self.max_blocks_per_seq + 1):
            tables.setdefault(self.blocks_bucket(m), []).append(m)
        decode_seqs = seqs_buckets(max_num_seqs, True, self.widest_seqs)
        shapes = [StepShape(s, s, b, 1) for s in decode_seqs for b in tables]  # decode
        seq_buckets = seqs_buckets(max_num_seqs, False, self.widest_seqs)
        token_buckets = powers_of_two(
            MIN_TOKENS_BUCKET, next_pow2(max_num_batched_tokens, MIN_TOKENS_BUCKET)
        )
        max_q = min(max_num_batched_tokens, self.max_model_len - 1)  # a query needs a token
        for t, s, (b, m) in itertools.product(token_buckets, seq_buckets, tables.items()):
            lo = 1 if t == MIN_TOKENS_BUCKET else t // 2 + 1
            tokens = (lo, min(t, max_num_batched_tokens))
            # The longest query q (2 .. max_q) picks min(query_bucket(q), t).
            queries: dict[int, list[int]] = {}
            edge, prev = MIN_QUERY_BUCKET, 1
            while prev < max_q:
                span = (prev + 1, min(edge, max_q))
                queries.setdefault(self.max_query_bucket(edge, t), []).append(span)
                prev, edge = edge, query_bucket(edge + 1)
            for q, spans in sorted(queries.items()):
                if any(
                    _packable(tokens, min(s, max_num_seqs), span, max(m) * self.block_size)
                    for span in spans
                ):
                    shapes.append(StepShape(t, s, b, q))
        return shapes

    def logits_per_step(self, decode: bool) -> int:
        """Logits rows per sequence slot: one in a decode step, else ``logits_per_seq``."""
        return 1 if decode else self.logits_per_seq

    def sample_rows(self, seqs: list[ScheduledSeq], step_input: StepInput):
        """For the sampler's rows (one per logits row of ``step_input``): the logits row each
        samples (i32) and, in a step that can verify proposals, the proposal each verifies (i32,
        -1: none; else None)."""
        size = len(step_input.logits_indices)
        per_seq = size // len(step_input.context_lens)
        logit_rows, drafts = np.zeros(size, np.int32), np.full(size, -1, np.int32)
        if per_seq == 1:  # no proposals: each sample row reads its sequence's one logits row
            counts = np.fromiter((len(s.samples) for s in seqs), np.int64, len(seqs))
            logit_rows[: counts.sum()] = np.repeat(np.arange(len(seqs)), counts)
            return logit_rows, None
        r = 0
        for i, s in enumerate(seqs):
            for j in range(len(s.samples)):
                logit_rows[r] = i * per_seq + (j if s.num_spec_tokens else 0)
                if j < s.num_spec_tokens:
                    drafts[r] = s.token_ids[len(s.token_ids) - s.num_spec_tokens + j]
                r += 1
        return logit_rows, drafts

    def empty(self, shape: StepShape) -> StepInput:
        """An all-padding step input of ``shape`` (for lowering)."""
        t, s, b = shape.num_tokens, shape.num_seqs, shape.max_blocks
        return StepInput(
            token_ids=np.zeros(t, np.int32),
            positions=np.zeros(t, np.int32),
            slot_mapping=np.full(t, -1, np.int32),
            block_tables=np.zeros((s, b), np.int32),
            context_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            logits_indices=np.zeros(s * self.logits_per_step(shape.max_query_len == 1), np.int32),
            max_query_len=shape.max_query_len,
            lora_slot=np.zeros(t, np.int32) if self.lora else None,
        )


def count_padding(
    profile,
    seqs: list[ScheduledSeq],
    step_input: StepInput,
    block_size: int,
    rows_only: bool = False,
) -> str:
    """Record a step's real and padded work in ``profile`` (a StepProfile); returns the step's
    kind. Attention work is query rows x keys: real, each row's causal context; padded, what the
    attention path computes for the bucketed shape: the real work where it reads only each row's
    keys (``rows_only``: the native CPU kernel), else every padded row over the table width (a
    decode step, and the CPU reference, whose query bound is the token bucket), or, for the
    kernels, every sequence slot x its query bucket over the table width."""
    q_lens = [len(s.token_ids) for s in seqs]
    real_attn = kv_pages = 0  # kv_pages: each sequence's whole pages up to its context
    for s, q in zip(seqs, q_lens, strict=True):
        ctx = s.start_pos + q
        real_attn += q * ctx - q * (q - 1) // 2
        kv_pages += cdiv(ctx, block_size)
    num_slots, width = step_input.block_tables.shape
    max_q = step_input.max_query_len
    kind = "decode" if max_q == 1 else "prefill" if min(q_lens) > 1 else "mixed"
    if rows_only:
        padded_attn = real_attn
    else:
        rows = num_slots * max_q if max_q < len(step_input.token_ids) else len(step_input.token_ids)
        padded_attn = rows * width * block_size
    profile.count(kind, sum(q_lens), len(step_input.token_ids), real_attn, padded_attn, kv_pages)
    return kind


def _packable(tokens, max_seqs: int, queries, max_context: int) -> bool:
    """Whether some batch has a token count in ``tokens`` (lo, hi), at most ``max_seqs``
    sequences, a longest query in ``queries`` (lo, hi) and contexts of at most ``max_context``:
    n sequences whose longest query is q hold q + n - 1 .. n * q tokens."""
    for n in range(1, max_seqs + 1):
        lo = max(queries[0], cdiv(tokens[0], n))
        hi = min(queries[1], tokens[1] - n + 1, max_context)
        if lo <= hi:
            return True
    return False


def moves_bucket(n: int) -> int:
    """The padded length of a block move of ``n`` blocks: a power of eight (8, 64, 512, ...), so
    that copies and swaps of any size take three or four programs each."""
    b = 8
    while b < n:
        b *= 8
    return b


def padded_ids(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Two id columns padded with -1 to ``moves_bucket`` (bounded programs)."""
    ids = np.full((2, moves_bucket(len(pairs))), -1, np.int32)
    if pairs:
        ids[:, : len(pairs)] = np.asarray(pairs, np.int32).T
    return ids[0], ids[1]
