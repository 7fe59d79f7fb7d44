"""The one place host lists become device arrays.

Each step: build one ``StepInput`` (numpy, padded to shape buckets so a long run compiles a bounded
set of programs; block-table rows persist across steps, worker/persistent_batch.py), packed with
the sampler's logits rows into one int32 buffer (one transfer), then run ONE jitted program, the
step program with the KV pool donated: async scheduling's token fill, the model and the sampling
of a plain greedy batch or of a sampled decode step, its sampling input in the same buffer
(worker/step_program.py); its one output array is copied to the host as soon as it is
dispatched. A prefill step that needs more than greedy, and a batch with penalties, logit bias or
an allowed-token mask, run the sampler program on the gathered logits rows after it. The model's
work (token / sequence / context / query buckets) picks a step program, and in a decode step the
sampler variant too (a handful: worker/step_program.py's ``step_variants``); otherwise sampling
options pick among a few small sampler programs.
``warmup`` compiles the whole bucket set up front; a server compiles ``startup_jobs`` (the bucket
policy's common programs, worker/warmup_jobs.py) before it answers and the rest in the background.
Block copies and swaps requested by the scheduler run before the step that needs them. An engine
that speculates takes, in steps with queries longer than one token, the logits of 1 + k rows per
sequence (its last token and its proposals) and samples them with the verify program
(``pagedjax.worker.rejection``), which also says which proposals were accepted; its decode
steps are the plain engine's.

Padding and buckets are input_batch's; the pool, its host mirror and block moves kv_cache's; the
jitted programs programs'; compiling and warm-up runner_compile's (the program set:
warmup_jobs'). What the engine needs of a runner is worker/runner_protocol.py's ``ModelRunner``.

With a LoRA config the runner holds the adapters' device slots (``Runner.lora``, worker/lora.py).

Every device operation goes through ``DeviceCalls`` (worker/device_calls.py): in a multi-process
run (``pagedjax.distributed``) the driver broadcasts it with its host arrays and the followers
replay it; it counts what compiles and keeps compiled programs within the memory-map limit.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pagedjax import compilation, pallas_kernels
from pagedjax.distributed import Channel
from pagedjax.inspection.step_profile import StepProfile
from pagedjax.lora.config import LoRAConfig
from pagedjax.models.config import ModelConfig
from pagedjax.models.linear import process_weights_after_loading
from pagedjax.models.quant import compute_dtype
from pagedjax.models.sharding import pool_sharding, shard_params
from pagedjax.models.step_input import StepInput
from pagedjax.pallas_kernels.layer_matmul import CpuLinearMethods
from pagedjax.worker import programs, prompt_logprobs, sampler, step_program
from pagedjax.worker.device_calls import DeviceCalls
from pagedjax.worker.forward import ModelForward
from pagedjax.worker.input_batch import (
    InputBatcher,
    ScheduledSeq,
    StepShape,
    count_padding,
    padded_ids,
)
from pagedjax.worker.kv_cache import KVCache, pool_dtype
from pagedjax.worker.lora import RunnerLoRA
from pagedjax.worker.persistent_batch import PersistentBatch
from pagedjax.worker.runner_compile import RunnerCompiler
from pagedjax.worker.runner_config import RunnerConfig
from pagedjax.worker.sampler import SamplingInput, SamplingRow
from pagedjax.worker.step_handle import StepHandle, StepOutput
from pagedjax.worker.step_ops import StepOps
from pagedjax.worker.warmup import Job, WarmupReport

__all__ = [
    "Runner",
    "RunnerConfig",
    "ScheduledSeq",
    "StepHandle",
    "StepOutput",
    "StepShape",
    "WarmupReport",
]

logger = logging.getLogger(__name__)


def placed(params, mesh: Mesh | None):
    """(params placed, the placement of host inputs, the pool's). Every array a program takes is
    committed to its placement, so the programs warm-up compiles are the ones the steps call
    (committed and uncommitted arguments differ)."""
    if mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        return jax.device_put(params, device), device, device
    return shard_params(params, mesh), NamedSharding(mesh, PartitionSpec()), pool_sharding(mesh)


def on_device(config: ModelConfig, params, sizes: RunnerConfig, mesh: Mesh | None, dtype):
    """(the weights in the layout the step reads, chosen once (models/linear.py), their weight
    layout, the placement of host inputs, the KV pool). With a mesh (tensor parallelism),
    weights and pool are split by heads across devices and host arrays are replicated to every
    device of the mesh."""
    params, inputs, pool = placed(params, mesh)
    params, linear = process_weights_after_loading(
        params, config, mesh, platform=CpuLinearMethods()
    )
    kv_cache = KVCache(
        config,
        num_blocks=sizes.num_blocks,
        block_size=sizes.block_size,
        num_host_blocks=sizes.num_host_blocks,
        dtype=pool_dtype(sizes.kv_cache_dtype, dtype),
        sharding=pool,
    )
    return params, linear, inputs, kv_cache


class Runner:
    """Owns the parameters, the device KV pool and the jitted step. ``sizes``: the pool and the
    engine's limits (worker/runner_config.py). ``backend``: the attention backend or its name
    (None: the PAGEDJAX_ATTENTION_BACKEND setting, else the platform's); ``mesh``: tensor
    parallelism; ``channel``: a multi-process run's."""

    # A draft model's runner (spec_decode/draft.py) sets this: its steps verify with q rows.
    verifies_draft_probs = False

    def __init__(
        self,
        config: ModelConfig,
        params,
        sizes: RunnerConfig,
        *,
        backend: str | pallas_kernels.AttentionBackend | None = None,
        mesh: Mesh | None = None,
        channel: Channel | None = None,
        profile: StepProfile | None = None,
    ):
        compilation.enable_persistent_cache()
        self.config, self.sizes, self.mesh = config, sizes, mesh
        block_size, max_num_seqs = sizes.block_size, sizes.max_num_seqs
        self.backend = pallas_kernels.select_backend(  # chosen once, passed to the model
            backend, block_size=block_size, head_dim=config.head_dim
        )
        self.block_size, self.num_blocks = block_size, sizes.num_blocks
        self.num_host_blocks, self.max_model_len = sizes.num_host_blocks, sizes.max_model_len
        self.num_speculative_tokens = sizes.num_speculative_tokens
        self.batcher = InputBatcher(
            block_size,
            sizes.max_model_len,
            1 + sizes.num_speculative_tokens,
            follows_context=self.backend.follows_context,
            max_num_seqs=max_num_seqs,
        )
        self.batcher.query_buckets = not self.backend.follows_rows
        self.max_blocks_per_seq = self.batcher.max_blocks_per_seq
        self.dtype = compute_dtype(params)  # linear kernels may be 8-bit (models/quant.py)
        self.params, self.linear, self._inputs, self.kv_cache = on_device(
            config, params, sizes, mesh, self.dtype
        )
        self.statics = programs.ModelStatics(config, self.backend, mesh, self.linear)
        self.channel = channel  # set in a multi-process run
        self.calls = DeviceCalls(self.device_op, channel)  # every device operation's door
        self.lora = None if sizes.lora is None else self._lora(sizes.lora)
        # Every step's device tokens are i32[W] (worker/step_program.py); one placed zeros array
        # stands for the tokens of no step. Block-table rows are kept across steps
        # (worker/persistent_batch.py): room for two full steps.
        self.fill_width = step_program.fill_width(max_num_seqs)
        self.table_rows = PersistentBatch(2 * self.fill_width, self.max_blocks_per_seq)
        # the step's device operation, counting its programs and transfers
        self.step_ops = StepOps(self, self._inputs)
        self.profile = profile or StepProfile()
        # The profile's attention work: the native CPU kernel reads each row's own keys only.
        self._attention_rows_only = self.backend.reads_rows_only
        self.compiler = RunnerCompiler(self)
        self.model_forward = ModelForward(self)

    def _lora(self, lora: LoRAConfig) -> RunnerLoRA:
        self.batcher.lora = True  # each step carries its rows' slots
        where = self.kv_cache.sharding  # placed as the pool is
        return RunnerLoRA(lora, self.config, self.dtype, self.mesh, where, self.device)

    @property
    def dispatches_ahead(self) -> bool:
        """Whether ``dispatch`` takes the step before's device tokens (not in a multi-process
        run: followers replay from host arrays)."""
        return self.channel is None

    @property
    def shapes_built(self) -> list[StepShape]:
        return self.batcher.shapes_built

    def build_step_input(self, seqs: list[ScheduledSeq]) -> StepInput:
        return self.batcher.build(seqs)

    def execute(
        self, seqs: list[ScheduledSeq], num_top_logprobs: int = 0, draft_probs=None
    ) -> StepOutput:
        """Run one step. Returns the sampler's output as host arrays, one row per requested sample
        (sequence by sequence, in order; ``num_top_logprobs`` most likely tokens per row), and
        the prompt rows it scored.
        ``draft_probs``: f32[sampler rows, vocab], the proposer's q on each proposal's row."""
        handle = self.dispatch(seqs, num_top_logprobs, draft_probs)
        if self.profile.enabled:
            with self.profile.phase("device", handle.kind):
                jax.block_until_ready((handle.out, handle.scored))
        return self.fetch(handle)

    def dispatch(
        self,
        seqs: list[ScheduledSeq],
        num_top_logprobs: int = 0,
        draft_probs=None,
        prev_tokens: jax.Array | None = None,
    ) -> StepHandle:
        """Start one step on the device and return without waiting for it (JAX dispatches
        asynchronously); ``fetch`` brings its output to the host. ``prev_tokens``: the device
        tokens of the step before (``StepHandle.tokens``): a token id -1 - r in ``seqs`` is
        replaced, on the device, by row r of them (async scheduling, engine/step_loop.py)."""
        if prev_tokens is not None and self.channel is not None:
            raise ValueError("prev_tokens: followers cannot replay a device array (one process)")
        prof = self.profile
        with prof.phase("build"):
            step_input = self.batcher.build(seqs, self.table_rows)
            rows = [row for s in seqs for row in s.samples]
            logit_rows, drafts = self.batcher.sample_rows(seqs, step_input)
            # sampling: the sampler program's input; in_step: the one the step program samples
            # (a sampled decode step); neither: a plain greedy batch (nothing to build)
            sampling = in_step = None
            own_program = any(sampler.needs_own_program(r) for r in rows)
            if drafts is None and step_input.max_query_len == 1 and not own_program:
                if not sampler.plain_greedy(rows, num_top_logprobs):
                    in_step = self.sampling_input(rows, len(logit_rows))
            elif drafts is not None or not sampler.plain_greedy(rows, num_top_logprobs):
                sampling = self.sampling_input(rows, len(logit_rows), constrained=True)
            score_chunks = prompt_logprobs.chunks(seqs, len(step_input.token_ids))
        kind = count_padding(prof, seqs, step_input, self.block_size, self._attention_rows_only)
        packed, layout = step_program.pack_inputs(step_input, logit_rows, in_step)
        with prof.phase("device", kind):
            args = (packed, layout, sampling, drafts, draft_probs, score_chunks)
            args += () if prev_tokens is None else (prev_tokens,)
            out, tokens, scored = self.device("run_step", *args)
            if isinstance(out, jax.Array):
                out.copy_to_host_async()  # the one array fetch reads, on its way already
        return StepHandle(out, tokens, scored, seqs, len(rows), num_top_logprobs, kind)

    def fetch(self, handle: StepHandle) -> StepOutput:
        """Wait for a dispatched step; its output as host arrays (see ``execute``)."""
        with self.profile.phase("fetch"):
            scores = []
            if handle.scored:
                scored = prompt_logprobs.concat(jax.device_get(handle.scored))
                scores = prompt_logprobs.split_scores(handle.seqs, scored)
            if isinstance(handle.out, jax.Array):
                out = step_program.unpack_output(np.asarray(handle.out)[: handle.num_rows])
            else:
                out = jax.tree.map(lambda x: np.asarray(x)[: handle.num_rows], handle.out)
        k = min(handle.num_top_logprobs, out.top_token_ids.shape[1])
        out = out.replace(
            top_token_ids=out.top_token_ids[:, :k], top_logprobs=out.top_logprobs[:, :k]
        )
        return StepOutput(out, scores)

    def sampling_input(
        self, rows: list[SamplingRow], size: int, constrained: bool = False
    ) -> SamplingInput:
        """The rows' sampling input (``constrained``: with bias and bitmask columns, as every
        sampler program's is; a step program's never has them)."""
        vocab = self.config.vocab_size
        return SamplingInput.build(
            rows, size, vocab, history_width=self.max_model_len, constrained=constrained
        )

    # ---- compiling and warm-up (worker/runner_compile.py) ---------------------------------

    def step_shapes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
        return self.compiler.step_shapes(max_num_seqs, max_num_batched_tokens)

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, **kwargs) -> WarmupReport:
        """Compile the whole program set for these limits (``swap``, ``progress``)."""
        return self.compiler.warmup(max_num_seqs, max_num_batched_tokens, **kwargs)

    def warmup_jobs(self, max_num_seqs: int, max_num_batched_tokens: int, **kwargs) -> list[Job]:
        return self.compiler.warmup_jobs(max_num_seqs, max_num_batched_tokens, **kwargs)

    def startup_jobs(self, max_num_seqs: int, max_num_batched_tokens: int, **kwargs) -> list[Job]:
        return self.compiler.startup_jobs(max_num_seqs, max_num_batched_tokens, **kwargs)

    def program_bound(self, max_num_seqs: int, max_num_batched_tokens: int, swap=None) -> int:
        return self.compiler.program_bound(max_num_seqs, max_num_batched_tokens, swap)

    def compile(self, jobs: list[Job], **kwargs) -> WarmupReport:
        return self.compiler.compile(jobs, **kwargs)

    def place(self, tree):
        """Host arrays to the device, placed as every program's inputs are (not counted)."""
        return jax.device_put(tree, self._inputs)

    # ---- block moves (before the step that needs them) ------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer."""
        self.device("copy", *padded_ids(pairs))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for every layer."""
        if not self.num_host_blocks:
            raise ValueError("no host swap space: set swap_space_gib > 0 to swap")
        self.device("swap_out", *padded_ids(pairs))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for every layer."""
        self.device("swap_in", *padded_ids(pairs))

    def forward_logits(self, seqs: list[ScheduledSeq], all_positions: bool = False) -> np.ndarray:
        """The model step alone (worker/forward.py): logits of each sequence's last token, or
        of every scheduled token."""
        return self.model_forward.logits(seqs, all_positions)

    def forward(self, seqs: list[ScheduledSeq]) -> jax.Array:
        """The model step alone, with the steps' own program: the last tokens' logits."""
        return self.model_forward.bucketed(seqs)

    # ---- multi-process ---------------------------------------------------------------------

    def device_op(self, op: str):
        """The function behind device operation ``op`` (None for another message), run here
        alone: no follower sees it, no compile is counted, no observer called."""
        ops = {
            "run_step": self.step_ops.run_step,
            "run_forward": self.model_forward.run,
            "copy": self.kv_cache.copy,
            "swap_out": self.kv_cache.swap_out,
            "swap_in": self.kv_cache.swap_in,
            "load_lora": None if self.lora is None else self.lora.write,
        }
        return ops.get(op)

    def device(self, op: str, *args):
        """Run device operation ``op`` through the door (worker/device_calls.py)."""
        if not self.kv_cache.pages:
            raise RuntimeError("the engine is closed")
        return self.calls.run(op, *args)

    def follow(self):
        """Follower: replay the driver's device operations (worker/device_calls.py)."""
        return self.calls.follow()

    @property
    def num_compilations(self) -> int:
        """Programs compiled (or loaded) by this runner's device operations and warm-ups."""
        return self.calls.num_compilations

    @property
    def compile_seconds(self) -> float:
        return self.calls.compile_seconds

    def synchronize(self) -> None:
        """Wait for the device operations issued so far (the pool is the last thing they write)."""
        jax.block_until_ready(self.kv_cache.pages)

    def free_device_memory(self) -> None:
        """The pool, and the runner's hold on the parameters: the runner is unusable afterwards.
        The parameters are dropped, not deleted: placing them may have kept the caller's own
        arrays (a model loaded once and served by several runners)."""
        self.kv_cache.free()
        self.params = None
