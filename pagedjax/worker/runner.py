"""The one place host lists become device arrays.

Each step: build one ``StepInput`` (numpy, padded to shape buckets so a long run compiles a bounded
set of programs), then run two jitted programs: the model step with the KV pool donated,
``model_step(params, kv_pool, step_input) -> (logits f32[num_seqs, vocab], kv_pool)`` (the logits
of each sequence's last token), and the sampler, ``sample_step(logits, logit_rows, sampling) ->
SamplerOutput`` (one row per requested sample). Only the model's work (token / sequence / context
/ query buckets) picks a model program; sampling options pick among a few small sampler programs.
``warmup`` compiles the whole bucket set up front. Block copies and swaps requested by the
scheduler run before the step that needs them.

The pool (models/llama.py) holds every layer: layer ``l``'s block ``b`` is pool block
``l * num_blocks + b``, so a block move names that block in every layer.

In a multi-process run (``pagedjax.distributed``) every device operation goes through ``_call``:
the driver broadcasts it with its host arrays and the followers, looping in ``follow``, replay it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import time

import jax
import numpy as np
from jax._src import dispatch
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from tqdm.auto import tqdm

from pagedjax import compilation, pallas_kernels
from pagedjax.distributed import Channel
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import forward, init_kv_pool
from pagedjax.models.sharding import pool_sharding, shard_params
from pagedjax.models.step_input import StepInput
from pagedjax.worker.sampler import SamplerOutput, SamplingInput, SamplingRow, sample

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


def _model_step(params, kv_pool, step_input, config, backend, mesh):
    return forward(params, kv_pool, step_input, config, backend, mesh)


def _sample_step(logits, logit_rows, sampling):
    # logits: f32[num_seqs, vocab]; logit_rows: i32[num_rows], the sequence each row samples from
    return sample(logits[logit_rows], sampling)


# Module-level so that engines with the same model and shapes share compiled programs; static
# arguments are hashable configuration only (stable persistent-cache keys).
_step = jax.jit(_model_step, static_argnums=(3, 4, 5), donate_argnums=(1,))
_sample = jax.jit(_sample_step)
_forward = jax.jit(forward, static_argnums=(3, 4, 5), donate_argnums=(1,))

_compiles = 0  # programs compiled (or loaded from the persistent cache) in this process


def _count_compiles(event: str, duration_secs: float, **kwargs) -> None:
    global _compiles
    if event == dispatch.BACKEND_COMPILE_EVENT:
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)
compilation.track_compile_seconds()


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


@dataclasses.dataclass
class WarmupReport:
    programs: list[tuple[str, float]]  # (program, seconds to compile or load it)
    seconds: float  # wall time of the warm-up


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
        compilation.enable_persistent_cache()
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
        # Every array a program takes is committed to its placement, so the programs warm-up
        # compiles are the ones the steps call (committed and uncommitted arguments differ).
        if mesh is not None:
            self._inputs = NamedSharding(mesh, PartitionSpec())
            params = self.params = shard_params(params, mesh)
            pool = pool_sharding(mesh)
        else:
            self._inputs = pool = SingleDeviceSharding(jax.local_devices()[0])
            params = self.params = jax.device_put(params, pool)
        self.kv_pool = init_kv_pool(config, num_blocks, block_size, self.dtype, pool)
        self.num_host_blocks = num_host_blocks
        # Swapped-out blocks, per slice of the kv heads held on this process's devices:
        # (first head, end head) -> (k, v), numpy [heads, num_layers, num_host_blocks, bs, hd].
        self.host_pool: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.max_model_len = max_model_len
        self.num_compilations = 0  # programs compiled because of this runner's device operations
        self.compile_seconds = 0.0  # time spent tracing, lowering and compiling them
        self.channel = channel  # set in a multi-process run

    def build_step_input(self, seqs: list[ScheduledSeq]) -> StepInput:
        """Pack the sequences' tokens (numpy), padded to buckets. Row i of ``logits_indices`` is
        sequence i's last token; there are at least as many sequence slots as sample rows."""
        bs = self.block_size
        num_tokens = sum(len(s.token_ids) for s in seqs)
        max_q = max(len(s.token_ids) for s in seqs)
        num_rows = sum(len(s.samples) for s in seqs)
        num_seqs_b = bucket(max(len(seqs), num_rows), MIN_SEQS_BUCKET)
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
        logits_indices = np.zeros(num_seqs_b, np.int32)
        row = 0
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
            logits_indices[i] = row - 1
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
        logit_rows = np.zeros(len(step_input.logits_indices), np.int32)
        logit_rows[: len(rows)] = [i for i, s in enumerate(seqs) for _ in s.samples]
        sampling = self._sampling_input(rows, len(logit_rows), num_top_logprobs)
        out = self._call("_run_step", step_input, logit_rows, sampling)
        out = jax.tree.map(lambda x: np.asarray(x)[: len(rows)], out)
        k = min(num_top_logprobs, out.top_token_ids.shape[1])
        return out.replace(
            top_token_ids=out.top_token_ids[:, :k], top_logprobs=out.top_logprobs[:, :k]
        )

    def _sampling_input(self, rows: list[SamplingRow], size: int, num_top: int) -> SamplingInput:
        return SamplingInput.build(
            rows,
            size,
            self.config.vocab_size,
            min(num_top, self.config.vocab_size),
            history_width=self.max_model_len,
        )

    def _run_step(
        self, step_input: StepInput, logit_rows: np.ndarray, sampling: SamplingInput
    ) -> SamplerOutput:
        logits, self.kv_pool = _step(
            self.params,
            self.kv_pool,
            jax.device_put(step_input, self._inputs),
            self.config,
            self.backend,
            self.mesh,
        )
        return _sample(
            logits, jax.device_put(logit_rows, self._inputs), jax.device_put(sampling, self._inputs)
        )

    # ---- warm-up ---------------------------------------------------------------------------

    def _blocks_bucket(self, max_blocks: int) -> int:
        b = bucket(max_blocks, self.min_blocks_bucket)
        return max(min(b, self.max_blocks_per_seq), max_blocks)

    def step_shapes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
        """Every model-step shape ``build_step_input`` can produce for batches of at most
        ``max_num_seqs`` sequences (and sample rows) and ``max_num_batched_tokens`` tokens."""
        seq_buckets = _powers(MIN_SEQS_BUCKET, bucket(max_num_seqs, MIN_SEQS_BUCKET))
        tables: dict[int, list[int]] = {}  # block bucket -> longest tables padded to it
        for m in range(1, self.max_blocks_per_seq + 1):
            tables.setdefault(self._blocks_bucket(m), []).append(m)
        shapes = [StepShape(s, s, b, 1) for s in seq_buckets for b in tables]  # decode
        token_buckets = _powers(
            MIN_TOKENS_BUCKET, bucket(max_num_batched_tokens, MIN_TOKENS_BUCKET)
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
                queries.setdefault(min(edge, t), []).append(span)
                prev, edge = edge, edge * 4
            for q, spans in sorted(queries.items()):
                if any(
                    _packable(tokens, min(s, max_num_seqs), span, max(m) * self.block_size)
                    for span in spans
                ):
                    shapes.append(StepShape(t, s, b, q))
        return shapes

    def warmup(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        swap: bool | None = None,
        progress: bool = True,
    ) -> WarmupReport:
        """Compile every program a workload within these limits can need: each model-step
        shape, the sampler for each sequence bucket with and without penalties, and the block
        copy / swap programs. Compilation runs on a thread pool (XLA compiles outside the GIL);
        returns the seconds each program took (compiled, or loaded from the persistent cache)."""
        start = time.perf_counter()
        before = (_compiles, compilation.compile_seconds())
        jobs = []  # (name, lowering thunk)
        shapes = self.step_shapes(max_num_seqs, max_num_batched_tokens)
        for shape in shapes:
            jobs.append((f"model {shape}", lambda shape=shape: self._lower_step(shape)))
        for s in sorted({shape.num_seqs for shape in shapes}):
            for penalties in (False, True):
                name = f"sampler s{s}" + (" penalties" if penalties else "")
                jobs.append((name, lambda s=s, p=penalties: self._lower_sample(s, p)))
        swap = self.num_host_blocks > 0 if swap is None else swap
        max_moves = bucket(min(self.num_blocks, max_num_seqs * self.max_blocks_per_seq), 8)
        for n in _powers(8, max_moves):
            ids = np.full(n, -1, np.int32)
            jobs.append((f"copy_blocks {n}", lambda ids=ids: self._lower_block_op("copy", ids)))
            if swap:
                for op in ("gather", "scatter"):
                    jobs.append(
                        (f"{op}_blocks {n}", lambda op=op, ids=ids: self._lower_block_op(op, ids))
                    )
        report = WarmupReport([], 0.0)
        workers = max(1, min(len(jobs), os.cpu_count() or 1))

        def compile_one(name, lowered):
            t0 = time.perf_counter()
            lowered.compile()
            return name, time.perf_counter() - t0

        with (
            tqdm(total=len(jobs), desc="compiling", disable=not progress, unit="prog") as bar,
            concurrent.futures.ThreadPoolExecutor(workers) as pool,
        ):
            futures = []
            for name, lower in jobs:  # tracing and lowering hold the GIL: one at a time
                t0 = time.perf_counter()
                lowered = lower()
                lower_s = time.perf_counter() - t0
                futures.append(pool.submit(compile_one, name, lowered))
                futures[-1].lower_s = lower_s
            for future in concurrent.futures.as_completed(futures):
                name, secs = future.result()
                secs += future.lower_s
                report.programs.append((name, secs))
                logger.info("compiled %s in %.2f s", name, secs)
                bar.set_postfix_str(f"{name}: {secs:.2f} s", refresh=False)
                bar.update(1)
        self.num_compilations += _compiles - before[0]
        self.compile_seconds += compilation.compile_seconds() - before[1]
        report.seconds = time.perf_counter() - start
        return report

    def _lower_step(self, shape: StepShape):
        t, s, b = shape.num_tokens, shape.num_seqs, shape.max_blocks
        step_input = StepInput(
            token_ids=np.zeros(t, np.int32),
            positions=np.zeros(t, np.int32),
            slot_mapping=np.full(t, -1, np.int32),
            block_tables=np.zeros((s, b), np.int32),
            context_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            logits_indices=np.zeros(s, np.int32),
            max_query_len=shape.max_query_len,
        )
        return _step.lower(
            self.params,
            self.kv_pool,
            jax.device_put(step_input, self._inputs),
            self.config,
            self.backend,
            self.mesh,
        )

    def _logits_like(self, num_seqs: int):
        """An array placed like the model step's logits, so the sampler compiled here is the one
        the steps call."""
        return jax.device_put(
            np.zeros((num_seqs, self.config.vocab_size), np.float32), self._inputs
        )

    def _lower_sample(self, num_seqs: int, penalties: bool):
        rows = [SamplingRow(repetition_penalty=1.5)] if penalties else []
        sampling = self._sampling_input(rows, num_seqs, 0)
        return _sample.lower(
            self._logits_like(num_seqs),
            jax.device_put(np.zeros(num_seqs, np.int32), self._inputs),
            jax.device_put(sampling, self._inputs),
        )

    def _lower_block_op(self, op: str, ids: np.ndarray):
        layer_ids = self._layer_ids(ids)
        if op == "copy":
            return pallas_kernels.copy_blocks.lower(self.kv_pool, layer_ids, layer_ids)
        if op == "gather":
            return pallas_kernels.gather_blocks.lower(self.kv_pool, layer_ids)
        blocks = jax.eval_shape(pallas_kernels.gather_blocks, self.kv_pool, layer_ids)
        blocks = jax.tree.map(
            lambda b, p: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=p.sharding),
            blocks,
            self.kv_pool,
        )
        return pallas_kernels.scatter_blocks.lower(self.kv_pool, layer_ids, blocks)

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

    def _layer_ids(self, blocks: np.ndarray) -> np.ndarray:
        """Block ids (-1 = padding) -> the same blocks in every layer, layer-major."""
        layers = np.arange(self.config.num_layers, dtype=np.int32)[:, None] * self.num_blocks
        return np.where(blocks < 0, -1, layers + blocks[None, :]).reshape(-1).astype(np.int32)

    def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.kv_pool = pallas_kernels.copy_blocks(
            self.kv_pool, self._layer_ids(src), self._layer_ids(dst)
        )

    def _swap_out(self, dev: np.ndarray, host: np.ndarray) -> None:
        # Each process keeps its own devices' slices of the kv heads (the only ones it can read);
        # a slice held by several devices is kept once.
        blocks = pallas_kernels.gather_blocks(self.kv_pool, self._layer_ids(dev))
        n = int((dev >= 0).sum())
        moves = {  # (k or v, head slice) -> device array [heads, num_layers * n_b, bs, hd]
            (kv, _heads(shard)): shard.data
            for kv, gathered in enumerate(blocks)
            for shard in gathered.addressable_shards
        }
        fetched = jax.device_get(list(moves.values()))  # all transfers at once
        for (kv, heads), data in zip(moves, fetched, strict=True):
            data = data.reshape(data.shape[0], self.config.num_layers, -1, *data.shape[2:])
            self._host_blocks(heads)[kv][:, :, host[:n]] = data[:, :, :n]

    def _swap_in(self, host: np.ndarray, dev: np.ndarray) -> None:
        host = np.where(host < 0, 0, host)  # padding rows carry host block 0; dev -1 drops them

        def load(pages: jax.Array, kv: int) -> jax.Array:
            # This process's slices of the blocks, assembled into one array sharded like the pool.
            shards = []
            for s in pages.addressable_shards:
                blocks = self._host_blocks(_heads(s))[kv][:, :, host]  # [h, L, n_b, bs, hd]
                blocks = blocks.reshape(blocks.shape[0], -1, *blocks.shape[3:])
                shards.append(jax.device_put(blocks, s.device))
            shape = (pages.shape[0], self.config.num_layers * len(host), *pages.shape[2:])
            return jax.make_array_from_single_device_arrays(shape, pages.sharding, shards)

        blocks = tuple(load(pages, kv) for kv, pages in enumerate(self.kv_pool))
        self.kv_pool = pallas_kernels.scatter_blocks(self.kv_pool, self._layer_ids(dev), blocks)

    def _host_blocks(self, heads: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        if heads not in self.host_pool:
            shape = (heads[1] - heads[0], self.config.num_layers, self.num_host_blocks)
            shape += (self.block_size, self.config.head_dim)
            dtype = np.dtype(self.dtype)
            self.host_pool[heads] = (np.zeros(shape, dtype), np.zeros(shape, dtype))
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
        """Run device operation ``op`` here and, in a multi-process run, on every follower;
        counts the programs it compiles."""
        if not self.kv_pool:
            raise RuntimeError("the engine is closed")
        if self.channel is not None:
            self.channel.send((op, args))
        compiles, seconds = _compiles, compilation.compile_seconds()
        try:
            return getattr(self, op)(*args)
        finally:
            self.num_compilations += _compiles - compiles
            self.compile_seconds += compilation.compile_seconds() - seconds

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
        for pages in self.kv_pool:
            pages.delete()
        self.kv_pool = ()


_DEVICE_OPS = frozenset({"_run_step", "_run_forward", "_copy", "_swap_out", "_swap_in"})


def _heads(shard) -> tuple[int, int]:
    """The kv heads ``[start, end)`` that a shard of a pool-shaped array holds."""
    start = shard.index[0].start or 0
    return start, start + shard.data.shape[0]


def _powers(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` (both powers of two), inclusive."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


def _packable(tokens, max_seqs: int, queries, max_context: int) -> bool:
    """Whether some batch has a token count in ``tokens`` (lo, hi), at most ``max_seqs``
    sequences, a longest query in ``queries`` (lo, hi) and contexts of at most ``max_context``:
    n sequences whose longest query is q hold q + n - 1 .. n * q tokens."""
    for n in range(1, max_seqs + 1):
        lo = max(queries[0], -(-tokens[0] // n))
        hi = min(queries[1], tokens[1] - n + 1, max_context)
        if lo <= hi:
            return True
    return False


def _padded_ids(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Two id columns padded with -1 to a power of two (bounded programs)."""
    ids = np.full((2, bucket(len(pairs), 8)), -1, np.int32)
    if pairs:
        ids[:, : len(pairs)] = np.asarray(pairs, np.int32).T
    return ids[0], ids[1]
