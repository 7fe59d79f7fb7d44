"""The one place host lists become device arrays.

Each step: build one ``StepInput`` (numpy, padded to shape buckets so a long run compiles a bounded
set of programs), then call one jitted step with the KV pool donated:
``step(params, kv_pool, step_input, sampling) -> (SamplerOutput, kv_pool)``. Block copies and
swaps requested by the scheduler run before the step that needs them.

In a multi-process run (``pagedjax.distributed``) every device operation goes through ``_call``:
the driver broadcasts it with its host arrays and the followers, looping in ``follow``, replay it.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_kernels
from models.config import ModelConfig
from models.llama import forward, init_kv_pool
from models.sharding import pool_sharding, shard_params
from models.step_input import StepInput
from pagedjax.distributed import Channel
from pagedjax.sampler import SamplerOutput, SamplingInput, SamplingRow, sample

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    token_ids: list[int]  # tokens whose K/V this step computes and writes
    start_pos: int  # position of token_ids[0] (= tokens already in the pool)
    block_table: list[int]  # physical blocks covering positions 0 .. start_pos + len(token_ids)
    # Tokens to sample from this chunk's last logits: none for a prompt chunk that does not
    # finish the prompt, n for the first tokens of a parallel-sampling request.
    samples: list[SamplingRow] = dataclasses.field(default_factory=list)


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def query_bucket(n: int) -> int:
    """Coarser buckets (powers of four from 16) for the longest query of a prefill step."""
    b = MIN_QUERY_BUCKET
    while b < n:
        b *= 4
    return b


# Smallest buckets: below these, padding is cheaper than another compiled program.
MIN_TOKENS_BUCKET = 32
MIN_SEQS_BUCKET = 8
MIN_CONTEXT_BUCKET = 256  # tokens of context covered by the smallest block-table bucket
MIN_QUERY_BUCKET = 16

_num_traces = 0  # total traces of the step function in this process (each one a compilation)


def _step_fn(params, kv_pool, step_input, sampling, config, backend, mesh):
    global _num_traces
    _num_traces += 1  # runs only while tracing, i.e. once per new program
    logits, kv_pool = forward(params, kv_pool, step_input, config, backend, mesh)
    return sample(logits, sampling), kv_pool


# Module-level so that engines with the same model and shapes share compiled programs.
_step = jax.jit(_step_fn, static_argnums=(4, 5, 6), donate_argnums=(1,))
_forward = jax.jit(forward, static_argnums=(3, 4, 5), donate_argnums=(1,))


class Runner:
    """Owns the parameters, the device KV pool and the jitted step."""

    def __init__(
        self,
        config: ModelConfig,
        params,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_host_blocks: int = 0,
        backend: str = "auto",
        mesh: Mesh | None = None,
        channel: Channel | None = None,
    ):
        self.config = config
        self.params = params
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.min_blocks_bucket = min(self.max_blocks_per_seq, -(-MIN_CONTEXT_BUCKET // block_size))
        self.dtype = jax.tree.leaves(params)[0].dtype
        # With a mesh (tensor parallelism), weights and pool are split by heads across devices
        # and host arrays are replicated to every device of the mesh.
        self.mesh = mesh
        self._inputs = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        if mesh is not None:
            params = self.params = shard_params(params, mesh)
        pool = pool_sharding(mesh) if mesh is not None else None
        self.kv_pool = init_kv_pool(config, num_blocks, block_size, self.dtype, pool)
        self.num_host_blocks = num_host_blocks
        # Swapped-out blocks, per slice of the kv heads held on this process's devices:
        # (first head, end head) -> per layer (k, v), numpy [heads, num_host_blocks, bs, hd].
        self.host_pool: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
        self.num_compilations = 0  # programs compiled because of this runner's steps
        self.channel = channel  # set in a multi-process run

    def build_step_input(self, seqs: list[ScheduledSeq]) -> StepInput:
        """Pack the sequences' tokens (numpy), padded to buckets."""
        bs = self.block_size
        num_tokens = sum(len(s.token_ids) for s in seqs)
        max_q = max(len(s.token_ids) for s in seqs)
        num_seqs_b = bucket(len(seqs), MIN_SEQS_BUCKET)
        decode = max_q == 1
        num_tokens_b = num_seqs_b if decode else bucket(num_tokens, MIN_TOKENS_BUCKET)
        max_blocks = max(len(s.block_table) for s in seqs)
        max_blocks_b = max(
            min(bucket(max_blocks, self.min_blocks_bucket), self.max_blocks_per_seq), max_blocks
        )

        token_ids = np.zeros(num_tokens_b, np.int32)
        positions = np.zeros(num_tokens_b, np.int32)
        slots = np.full(num_tokens_b, -1, np.int32)
        tables = np.zeros((num_seqs_b, max_blocks_b), np.int32)
        context_lens = np.zeros(num_seqs_b, np.int32)
        # Decode layout keeps row i = sequence i, so padding sequences own the padding rows.
        qsl = (
            np.arange(num_seqs_b + 1, dtype=np.int32)
            if decode
            else np.full(num_seqs_b + 1, num_tokens, np.int32)
        )
        num_rows = sum(len(s.samples) for s in seqs)
        logits_indices = np.zeros(bucket(num_rows, MIN_SEQS_BUCKET), np.int32)
        row = sample_row = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            pos = np.arange(s.start_pos, s.start_pos + n)
            table = np.asarray(s.block_table, np.int32)
            token_ids[row : row + n] = s.token_ids
            positions[row : row + n] = pos
            slots[row : row + n] = table[pos // bs] * bs + pos % bs
            tables[i, : len(table)] = table
            context_lens[i] = s.start_pos + n
            qsl[i] = row
            row += n
            logits_indices[sample_row : sample_row + len(s.samples)] = row - 1
            sample_row += len(s.samples)
        if not decode:
            qsl[len(seqs) :] = row
        return StepInput(
            token_ids=token_ids,
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            context_lens=context_lens,
            query_start_loc=qsl,
            logits_indices=logits_indices,
            max_query_len=1 if decode else min(query_bucket(max_q), num_tokens_b),
        )

    def execute(self, seqs: list[ScheduledSeq], num_top_logprobs: int = 0) -> SamplerOutput:
        """Run one step. Returns the sampler's output as host arrays, one row per requested sample
        (sequence by sequence, in order); ``num_top_logprobs`` most likely tokens per row."""
        step_input = self.build_step_input(seqs)
        rows = [row for s in seqs for row in s.samples]
        sampling = SamplingInput.build(
            rows,
            len(step_input.logits_indices),
            self.config.vocab_size,
            min(bucket(num_top_logprobs), self.config.vocab_size) if num_top_logprobs else 0,
        )
        out = self._call("_run_step", step_input, sampling)
        return jax.tree.map(lambda x: np.asarray(x)[: len(rows)], out)

    def _run_step(self, step_input: StepInput, sampling: SamplingInput) -> SamplerOutput:
        traces = _num_traces
        out, self.kv_pool = _step(
            self.params,
            self.kv_pool,
            jax.device_put(step_input, self._inputs),
            jax.device_put(sampling, self._inputs),
            self.config,
            self.backend,
            self.mesh,
        )
        self.num_compilations += _num_traces - traces
        return out

    # ---- block moves (before the step that needs them) ------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer."""
        self._call("_copy", *_padded_ids(pairs))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for every layer."""
        if not self.num_host_blocks:
            raise ValueError("no host swap space: set swap_space_gib > 0 to swap")
        self._call("_swap_out", *_padded_ids(pairs))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for every layer."""
        self._call("_swap_in", *_padded_ids(pairs))

    def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.kv_pool = pallas_kernels.copy_blocks(self.kv_pool, src, dst)

    def _swap_out(self, dev: np.ndarray, host: np.ndarray) -> None:
        # Each process keeps its own devices' slices of the kv heads (the only ones it can read);
        # a slice held by several devices is kept once.
        blocks = pallas_kernels.gather_blocks(self.kv_pool, dev)  # per layer [Hkv, n_b, bs, hd]
        n = int((dev >= 0).sum())
        moves = {  # (layer, k or v, head slice) -> device array of those heads' blocks
            (layer, kv, _heads(shard)): shard.data
            for layer, pair in enumerate(blocks)
            for kv, gathered in enumerate(pair)
            for shard in gathered.addressable_shards
        }
        fetched = jax.device_get(list(moves.values()))  # all transfers at once
        for (layer, kv, heads), data in zip(moves, fetched, strict=True):
            self._host_blocks(heads)[layer][kv][:, host[:n]] = data[:, :n]

    def _swap_in(self, host: np.ndarray, dev: np.ndarray) -> None:
        host = np.where(host < 0, 0, host)  # padding rows carry host block 0; dev -1 drops them

        def load(pages: jax.Array, layer: int, kv: int) -> jax.Array:
            # This process's slices of the blocks, assembled into one array sharded like the pool.
            shards = [
                jax.device_put(self._host_blocks(_heads(s))[layer][kv][:, host], s.device)
                for s in pages.addressable_shards
            ]
            shape = (pages.shape[0], len(host), *pages.shape[2:])
            return jax.make_array_from_single_device_arrays(shape, pages.sharding, shards)

        blocks = tuple(
            (load(k, layer, 0), load(v, layer, 1)) for layer, (k, v) in enumerate(self.kv_pool)
        )
        self.kv_pool = pallas_kernels.scatter_blocks(self.kv_pool, dev, blocks)

    def _host_blocks(self, heads: tuple[int, int]) -> list[tuple[np.ndarray, np.ndarray]]:
        if heads not in self.host_pool:
            shape = (heads[1] - heads[0], self.num_host_blocks, self.block_size)
            shape += (self.config.head_dim,)
            dtype = np.dtype(self.dtype)
            self.host_pool[heads] = [
                (np.zeros(shape, dtype), np.zeros(shape, dtype))
                for _ in range(self.config.num_layers)
            ]
        return self.host_pool[heads]

    def forward_logits(self, seqs: list[ScheduledSeq], all_positions: bool = False) -> np.ndarray:
        """Logits for the last token of each sequence, or for every scheduled token (testing and
        scoring); writes the tokens' K/V into the pool like a normal step."""
        step_input = self.build_step_input(seqs)
        lengths = np.asarray([len(s.token_ids) for s in seqs])
        rows = np.arange(lengths.sum()) if all_positions else np.cumsum(lengths) - 1
        step_input = step_input.replace(logits_indices=rows.astype(np.int32))
        return np.asarray(self._call("_run_forward", step_input))

    def _run_forward(self, step_input: StepInput) -> jax.Array:
        logits, self.kv_pool = _forward(
            self.params,
            self.kv_pool,
            jax.device_put(step_input, self._inputs),
            self.config,
            self.backend,
            self.mesh,
        )
        return logits

    # ---- multi-process ---------------------------------------------------------------------

    def _call(self, op: str, *args):
        """Run device operation ``op`` here and, in a multi-process run, on every follower."""
        if not self.kv_pool:
            raise RuntimeError("the engine is closed")
        if self.channel is not None:
            self.channel.send((op, args))
        return getattr(self, op)(*args)

    def follow(self):
        """Follower: replay the driver's device operations until a message that is not one
        (the caller's business, e.g. "stop"); returns that message as ``(op, payload)``."""
        while True:
            op, args = self.channel.recv()
            if op not in _DEVICE_OPS:
                return op, args
            try:
                getattr(self, op)(*args)
            except Exception:  # the driver meets the same failure; its next message says more
                logger.exception("device operation %s failed on this follower", op)

    def free_device_memory(self) -> None:
        for k, v in self.kv_pool:
            k.delete()
            v.delete()
        self.kv_pool = ()


_DEVICE_OPS = frozenset({"_run_step", "_run_forward", "_copy", "_swap_out", "_swap_in"})


def _heads(shard) -> tuple[int, int]:
    """The kv heads ``[start, end)`` that a shard of a pool-shaped array holds."""
    start = shard.index[0].start or 0
    return start, start + shard.data.shape[0]


def _padded_ids(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Two id columns padded with -1 to a power of two (bounded programs)."""
    ids = np.full((2, bucket(len(pairs), 8)), -1, np.int32)
    if pairs:
        ids[:, : len(pairs)] = np.asarray(pairs, np.int32).T
    return ids[0], ids[1]
