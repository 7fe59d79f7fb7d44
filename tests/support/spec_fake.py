"""A fake runner that verifies proposals, for driving the real engine with speculation on.

It extends tests/support/fake_model.py's FakeRunner: the proposals' tokens are written to their
slots like any other, and row j of a sequence with p proposals reads its context back through the
block table up to the token before position ``start + 1 + j``, so a lookahead slot that was not
allocated, or a rejected token's slot read as if it held an accepted one, changes the output.

Two fake models: "hash" (the next token is a hash of the whole context: proposals are almost
never right) and "induction" (the token that followed the latest earlier occurrence of the last
token, else a hash: it continues whatever repeats, as copying language models do).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
from fake_model import VOCAB, FakeRunner, StaleSlotError, fake_engine, next_token, ranked_tokens

from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.utils import cdiv
from pagedjax.worker.runner import StepOutput


class SpecPicks(NamedTuple):
    tokens: np.ndarray  # i32[rows]
    logprobs: np.ndarray  # f32[rows]
    top_token_ids: np.ndarray  # i32[rows, K]
    top_logprobs: np.ndarray  # f32[rows, K]
    accepted: np.ndarray  # bool[rows]


def model_token(kind: str, context: list[int], seed: int) -> int:
    if kind == "induction":
        last = context[-1]
        for i in range(len(context) - 2, -1, -1):
            if context[i] == last:
                return context[i + 1]
    return next_token(context, seed)


class SpecFakeRunner(FakeRunner):
    model = "hash"

    def __init__(self, config, params, sizes, **kwargs):
        super().__init__(config, params, sizes, **kwargs)
        self.num_speculative_tokens = sizes.num_speculative_tokens
        self.num_proposed = 0

    def execute(self, seqs, num_top_logprobs: int = 0) -> StepOutput:
        self.num_steps += 1
        k = max(num_top_logprobs, 1)
        tokens, logprobs, top_ids, top_lps, accepted = [], [], [], [], []
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            assert len(s.block_table) >= cdiv(end, self.block_size), "no slot for a token"
            if 0 in s.block_table[: cdiv(end, self.block_size)]:
                raise AssertionError(f"the null block in a live block table: {s.block_table}")
            self.pool[self._slots(s.block_table, s.start_pos, end)] = s.token_ids
            p = s.num_spec_tokens
            assert p <= self.num_speculative_tokens
            assert not p or len(s.samples) == p + 1
            self.num_proposed += p
            for j, row in enumerate(s.samples):
                stop = end - p + j if p else end
                context = self.pool[self._slots(s.block_table, 0, stop)].tolist()
                if -1 in context:
                    raise StaleSlotError(f"read an unwritten slot: context {context}")
                assert row.position == len(context), (row.position, len(context))
                token = model_token(self.model, context, row.seed if row.temperature > 0 else 0)
                draft = s.token_ids[len(s.token_ids) - p + j] if j < p else -1
                ids, lps = ranked_tokens(context, VOCAB)  # the whole ranking: batch-invariant
                tokens.append(token)
                accepted.append(token == draft)
                logprobs.append(lps[ids.index(token)])
                top_ids.append(ids[:k])
                top_lps.append(lps[:k])
        n = len(tokens)
        picks = SpecPicks(
            np.asarray(tokens, np.int32),
            np.asarray(logprobs, np.float32),
            np.asarray(top_ids, np.int32).reshape(n, k),
            np.asarray(top_lps, np.float32).reshape(n, k),
            np.asarray(accepted, bool),
        )
        return StepOutput(picks)


def spec_engine(speculative_config: dict | None, *, model: str = "hash", **kwargs) -> LLMEngine:
    """fake_model.fake_engine (its keyword arguments) with speculation configured and the runner
    that verifies proposals, on the fake ``model`` ("hash" or "induction")."""
    runner = type("Runner", (SpecFakeRunner,), {"model": model})
    return fake_engine(speculative_config=speculative_config, runner_factory=runner, **kwargs)


def check_blocks(engine: LLMEngine) -> None:
    """The block manager's invariants, and that every cached block holds its own tokens."""
    bm = engine.block_manager
    refs = Counter(b for table in bm.block_tables.values() for b in table)
    free = set(bm.free_block_ids) | set(bm.evictable)
    assert 0 not in refs and 0 not in free
    assert len(free) == len(bm.free_block_ids) + len(bm.evictable)
    for block in bm.blocks[1:]:
        assert (block.block_id in free) != (refs[block.block_id] > 0), block.block_id
        assert block.ref_count == refs[block.block_id]
    assert bm.get_num_free_blocks() + len(refs) == bm.num_blocks - 1
    pool, bs = engine.runner.pool, bm.block_size
    for block in bm.blocks[1:]:
        if block.key is not None:  # cached as computed: its slots hold exactly its tokens
            held = pool[block.block_id * bs : (block.block_id + 1) * bs].tolist()
            assert tuple(held) == block.key[1], (block.block_id, held, block.key)
    fills: dict[int, int] = {}
    for table in bm.block_tables.values():
        for block_id in table:
            fills[block_id] = bm.blocks[block_id].num_tokens
    assert bm._num_tokens_stored == sum(fills.values())


def run(engine: LLMEngine, prompts, params, *, abort_at: dict[str, int] | None = None):
    """Generate to the end, checking the invariants after every step; request id -> output."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        check_blocks(engine)
        for request_id, step in (abort_at or {}).items():
            if step == steps:
                engine.abort_request(request_id)
        assert steps < 10_000, "the engine does not finish"
    bm = engine.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks - 1, "leaked device blocks"
    assert bm.get_num_free_host_blocks() == bm.num_host_blocks, "leaked host blocks"
    return outputs
