"""A fake model for driving the real engine's host side without compiling anything.

The "model" reads its context back through the block table from a fake pool of token ids, so a
wrong block table, a copy-on-write or swap that moved the wrong block, or a stale slot changes
its output (or raises): its next token is a hash of exactly the tokens it was given.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import NamedTuple

import numpy as np
from pagedjax.models.config import ModelConfig
from pagedjax.models.loader import LoadedModel

from pagedjax.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.outputs import EngineStats
from pagedjax.worker.runner import RunnerConfig, StepOutput, WarmupReport

EOS = 2
VOCAB = 32
FAKE_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB,
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=8,
    max_position_embeddings=4096,
    eos_token_ids=(EOS,),
)
BYTES_PER_TOKEN = 2 * 1 * 8 * 1 * 4  # K and V, one head of 8 floats, one layer


class Picks(NamedTuple):
    tokens: np.ndarray  # i32[rows]
    logprobs: np.ndarray  # f32[rows]
    top_token_ids: np.ndarray  # i32[rows, K]
    top_logprobs: np.ndarray  # f32[rows, K]


def next_token(context: list[int], seed: int) -> int:
    """The fake model's sample for ``context`` (``seed`` 0 for greedy rows)."""
    data = np.asarray(context, np.int64).tobytes() + int(seed).to_bytes(4, "little")
    return zlib.crc32(data) % VOCAB


def ranked_tokens(context: list[int], k: int) -> tuple[list[int], list[float]]:
    """k distinct tokens, most likely first, with decreasing logprobs (for beams and logprobs)."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(context, np.int64).tobytes()))
    ids = rng.permutation(VOCAB)[:k].tolist()
    return ids, sorted(rng.uniform(-6.0, -0.1, k).tolist(), reverse=True)


class StaleSlotError(AssertionError):
    pass


class FakeRunner:
    """A ModelRunner (pagedjax/worker/runner_protocol.py) over a pool of token ids (one int per
    slot; -1 = never written): no device pool, no programs to compile, one process."""

    kv_cache = None
    lora = None
    channel = None
    dispatches_ahead = True

    def __init__(self, config, params, sizes: RunnerConfig, **_):
        self.config = config
        self.params = params
        self.block_size = sizes.block_size
        self.pool = np.full(sizes.num_blocks * self.block_size, -1, np.int64)
        self.host = np.full(max(sizes.num_host_blocks, 1) * self.block_size, -1, np.int64)
        self.num_host_blocks = sizes.num_host_blocks
        self.num_compilations = 0
        self.compile_seconds = 0.0
        self.num_steps = 0
        self.shapes_built = []

    def _slots(self, table: list[int], start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop)
        return np.asarray(table, np.int64)[pos // self.block_size] * self.block_size + (
            pos % self.block_size
        )

    def dispatch(self, seqs, num_top_logprobs: int = 0, prev_tokens=None) -> Picks:
        """Async scheduling: runs at once (the fake's "device" runs in dispatch order); token id
        -1 - r stands for row r of the step before's tokens (``prev_tokens``)."""
        if prev_tokens is not None:
            seqs = [
                dataclasses.replace(
                    s, token_ids=[int(prev_tokens[-1 - t]) if t < 0 else t for t in s.token_ids]
                )
                for s in seqs
            ]
        return self.execute(seqs, num_top_logprobs).sampled  # its tokens: the handle's

    def fetch(self, handle: Picks) -> StepOutput:
        return StepOutput(handle)

    def execute(self, seqs, num_top_logprobs: int = 0) -> StepOutput:
        self.num_steps += 1
        if any(t < 0 for s in seqs for t in s.token_ids):
            raise AssertionError(f"a placeholder token reached the model: {seqs}")
        k = max(num_top_logprobs, 1)
        tokens, logprobs, top_ids, top_lps = [], [], [], []
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            if s.block_table and 0 in s.block_table[: -(-end // self.block_size)]:
                raise AssertionError(f"the null block in a live block table: {s.block_table}")
            self.pool[self._slots(s.block_table, s.start_pos, end)] = s.token_ids
            if not s.samples:
                continue
            context = self.pool[self._slots(s.block_table, 0, end)].tolist()
            if -1 in context:
                raise StaleSlotError(f"read an unwritten slot: context {context}")
            for row in s.samples:
                assert row.position == len(context), (row.position, len(context))
                token = next_token(context, row.seed if row.temperature > 0 else 0)
                ids, lps = ranked_tokens(context, k)
                tokens.append(token)
                logprobs.append(lps[ids.index(token)] if token in ids else -7.0)
                top_ids.append(ids)
                top_lps.append(lps)
        picks = Picks(
            np.asarray(tokens, np.int32),
            np.asarray(logprobs, np.float32),
            np.asarray(top_ids, np.int32).reshape(len(tokens), k),
            np.asarray(top_lps, np.float32).reshape(len(tokens), k),
        )
        return StepOutput(picks)

    def _move(self, src_pool, dst_pool, pairs):
        bs = self.block_size
        for src, dst in pairs:
            dst_pool[dst * bs : (dst + 1) * bs] = src_pool[src * bs : (src + 1) * bs]

    def copy_blocks(self, pairs):
        self._move(self.pool, self.pool, pairs)

    def swap_out(self, pairs):
        if not self.num_host_blocks:
            raise ValueError("no host swap space")
        self._move(self.pool, self.host, pairs)

    def swap_in(self, pairs):
        self._move(self.host, self.pool, pairs)

    def synchronize(self):
        pass

    def free_device_memory(self):
        pass

    def follow(self):
        raise RuntimeError("the fake model runs in one process")

    # ---- compiling: the fake has no programs ------------------------------------------------

    def warmup_jobs(self, max_num_seqs: int, max_num_batched_tokens: int, *, swap=None):
        return []

    def startup_jobs(self, max_num_seqs: int, max_num_batched_tokens: int, *, default=None):
        return []

    def compile(self, jobs, **kwargs) -> WarmupReport:
        return WarmupReport([], 0.0)

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, **kwargs) -> WarmupReport:
        return WarmupReport([], 0.0)


def fake_engine(
    *,
    block_size: int = 8,
    num_blocks: int = 32,
    num_host_blocks: int = 0,
    max_model_len: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    preemption_mode: str = "recompute",
    seed: int = 0,
    async_scheduling: bool = True,
    speculative_config: dict | None = None,
    runner_factory=FakeRunner,
) -> LLMEngine:
    bytes_per_block = BYTES_PER_TOKEN * block_size
    config = EngineConfig(
        model="fake",
        seed=seed,
        cache=CacheConfig(
            block_size,
            num_blocks,
            None,
            (num_host_blocks + 0.5) * bytes_per_block / 2**30,
            enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs,
            max_model_len,
            max_num_batched_tokens,
            enable_chunked_prefill,
            preemption_mode,
        ),
        async_scheduling=async_scheduling,
        speculative_config=speculative_config,
    )
    loaded = LoadedModel(config=FAKE_CONFIG, params={}, source="fake", tokenizer_dir=None)
    return LLMEngine(config, loaded, runner_factory=runner_factory)


def idle_stats(**fields) -> EngineStats:
    """The stats of an engine of 8 blocks that has run nothing; ``fields`` replace any of them
    (the server's tests: a waiting request, speculation counts)."""
    base = dict(
        num_blocks_total=8,
        num_blocks_used=0,
        num_blocks_peak=0,
        kv_slots_allocated_peak=0,
        kv_tokens_stored_peak=0,
        kv_utilization=0.0,
        num_preemptions=0,
        num_swapped_out=0,
        prefix_cache_hit_rate=0.0,
        num_compilations=0,
    )
    return EngineStats(**{**base, **fields})
