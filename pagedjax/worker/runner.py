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
(``pagedjax.spec_decode.rejection``), which also says which proposals were accepted; its decode
steps are the plain engine's.

Padding and buckets are input_batch's; the pool, its host mirror and block moves kv_cache's; the
jitted programs programs'; their lowering for warm-up warmup_jobs'.

With a ``lora_config`` the runner holds LoRA adapters' device slots (worker/lora.py).

Every device operation goes through ``DeviceCalls`` (worker/device_calls.py): in a multi-process
run (``pagedjax.distributed``) the driver broadcasts it with its host arrays and the followers
replay it; it counts what compiles and keeps compiled programs within the memory-map limit.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pagedjax import compilation, executables, pallas_kernels
from pagedjax.distributed import Channel
from pagedjax.inspection.step_profile import StepProfile
from pagedjax.models.config import ModelConfig
from pagedjax.models.linear import process_weights_after_loading
from pagedjax.models.quant import compute_dtype
from pagedjax.models.sharding import pool_sharding, shard_params
from pagedjax.models.step_input import StepInput
from pagedjax.pallas_kernels.layer_matmul import CpuLinearMethods
from pagedjax.spec_decode.rejection import verify_step
from pagedjax.worker import programs, prompt_logprobs, sampler, step_program, warmup_jobs
from pagedjax.worker.device_calls import DeviceCalls
from pagedjax.worker.input_batch import (
    InputBatcher,
    ScheduledSeq,
    StepShape,
    count_padding,
    padded_ids,
)
from pagedjax.worker.kv_cache import KVCache, pool_dtype
from pagedjax.worker.lora import LoRASlotsHolder
from pagedjax.worker.persistent_batch import PersistentBatch
from pagedjax.worker.sampler import SamplingInput, SamplingRow
from pagedjax.worker.step_handle import StepHandle, StepOutput
from pagedjax.worker.warmup import Job, WarmupReport, compile_jobs

__all__ = ["Runner", "ScheduledSeq", "StepHandle", "StepOutput", "StepShape", "WarmupReport"]

logger = logging.getLogger(__name__)


def placed(params, mesh: Mesh | None):
    """(params placed, the placement of host inputs, the pool's). Every array a program takes is
    committed to its placement, so the programs warm-up compiles are the ones the steps call
    (committed and uncommitted arguments differ)."""
    if mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        return jax.device_put(params, device), device, device
    return shard_params(params, mesh), NamedSharding(mesh, PartitionSpec()), pool_sharding(mesh)


class Runner(LoRASlotsHolder):
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
        backend: str | pallas_kernels.AttentionBackend | None = None,
        mesh: Mesh | None = None,
        channel: Channel | None = None,
        profile: StepProfile | None = None,
        num_speculative_tokens: int = 0,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        lora_config=None,
    ):
        """``num_speculative_tokens``: proposals a sequence may verify per step (each step then
        returns logits for 1 + that many rows per sequence and samples with ``verify_step``).
        ``kv_cache_dtype``: the pool's ("auto": the compute dtype; "int8" / "fp8": 8-bit pages
        with scales, worker/kv_cache.py). ``max_num_seqs``: the engine's, which sets the width of
        every step's device tokens (worker/step_program.py). ``lora_config``: worker/lora.py."""
        compilation.enable_persistent_cache()
        self.config = config
        self.params = params
        # The attention backend, chosen once: by name (None: the PAGEDJAX_ATTENTION_BACKEND
        # setting, else the platform's), passed to the model as the object.
        self.backend = pallas_kernels.select_backend(
            backend, block_size=block_size, head_dim=config.head_dim
        )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_speculative_tokens = num_speculative_tokens
        self.batcher = InputBatcher(
            block_size,
            max_model_len,
            1 + num_speculative_tokens,
            follows_context=self.backend.follows_context,
            max_num_seqs=max_num_seqs,
        )
        self.batcher.query_buckets = not self.backend.follows_rows
        self.max_blocks_per_seq = self.batcher.max_blocks_per_seq
        self.dtype = compute_dtype(params)  # linear kernels may be 8-bit (models/quant.py)
        # With a mesh (tensor parallelism), weights and pool are split by heads across devices
        # and host arrays are replicated to every device of the mesh.
        self.mesh = mesh
        params, self._inputs, pool = placed(params, mesh)
        # The weights in the layout the step reads, chosen once (models/linear.py): one array
        # per layer, or stacked under the scan (on a CPU in the native kernels' layouts).
        params, self.linear = process_weights_after_loading(
            params, config, mesh, platform=CpuLinearMethods()
        )
        self.params = params
        self.kv_cache = KVCache(
            config,
            num_blocks=num_blocks,
            block_size=block_size,
            num_host_blocks=num_host_blocks,
            dtype=pool_dtype(kv_cache_dtype, self.dtype),
            sharding=pool,
        )
        self.num_host_blocks = num_host_blocks
        self.init_lora(lora_config, pool)
        self.max_model_len = max_model_len
        # Every step's device tokens are i32[W] (worker/step_program.py); one placed zeros array
        # stands for the tokens of no step.
        self.fill_width = step_program.fill_width(max_num_seqs)
        # Block-table rows kept across steps (worker/persistent_batch.py): room for two full
        # steps, so that sequences missing from one step keep theirs.
        self.table_rows = PersistentBatch(2 * self.fill_width, self.max_blocks_per_seq)
        self._zeros = None
        self.num_programs = 0  # programs the steps dispatched
        self.num_transfers = 0  # host arrays the steps sent to the device
        self.channel = channel  # set in a multi-process run
        self.calls = DeviceCalls(self.device_op, channel)  # every device operation's door
        self.profile = profile or StepProfile()
        # The profile's attention work: the native CPU kernel reads each row's own keys only.
        self._attention_rows_only = self.backend.reads_rows_only

    def build_step_input(self, seqs: list[ScheduledSeq]) -> StepInput:
        return self.batcher.build(seqs)

    # A draft model's runner (spec_decode/draft.py) sets this: its steps verify with q rows.
    verifies_draft_probs = False

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
            out, tokens, scored = self._call("run_step", *args)
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

    def _run_step(
        self,
        packed: np.ndarray,
        layout: step_program.StepLayout,
        sampling: SamplingInput | None,
        drafts: np.ndarray | None = None,
        draft_probs: np.ndarray | None = None,
        score_chunks: list[tuple[np.ndarray, np.ndarray]] = (),
        prev_tokens: jax.Array | None = None,
    ):
        """One step's programs: the step program (fill, model, and the sampling of a plain
        greedy batch or, its input packed in ``packed``, of a sampled decode step); else the
        sampler program (``sampling``) unless the batch is plain greedy; the verify program in a
        step that verifies; the score program for each chunk of prompt rows (``score_chunks``,
        worker/prompt_logprobs.py). Returns (output, tokens i32[W] or None, the chunks' scores,
        on the device)."""
        if prev_tokens is None:
            prev_tokens = self._no_tokens()
        outs, self.kv_cache.pages = self._launch(
            programs.step, *self._step_operands(packed, prev_tokens, layout)
        )
        model = (self.config, self.mesh, self.linear)
        scored = [
            self._launch(programs.score, self.params, outs["hidden"], *self._put(chunk), *model)
            for chunk in score_chunks
        ]
        if drafts is not None:
            # Speculation: rows with a proposal verify it (VerifyOutput: SamplerOutput +
            # accepted); the logits rows are the sampler's already.
            rows = np.arange(layout.num_logits, dtype=np.int32)
            args = (outs["logits"], *self._put((rows, sampling, drafts)))
            if draft_probs is not None:
                args += (self._put(draft_probs),)
            return self._launch(verify_step, *args), None, scored
        # A plain greedy batch (None: nothing built for it) or a sampled decode step (its
        # sampling input in the layout) is sampled in the step program.
        if sampling is None:
            return outs["packed"], outs["tokens"], scored
        packed_sampling, sampling_layout = step_program.pack_sampling(sampling)
        args = (outs["logits"], self._put(packed_sampling), sampling_layout, self.fill_width)
        return *self._launch(programs.sample, *args), scored

    def _host(self, packed: np.ndarray) -> np.ndarray:
        """A step's packed inputs, handed to the step program as a host array (counted: one
        transfer): jit's own transfer costs a fraction of a ``device_put`` before the call, and
        the program is lowered for a host array (worker/warmup_jobs.py), so it is the same one."""
        self.num_transfers += 1
        return packed

    def _put(self, tree):
        """Host arrays to the device (counted: ``num_transfers``, one per array)."""
        self.num_transfers += len(jax.tree.leaves(tree))
        return jax.device_put(tree, self._inputs)

    def _launch(self, program, *args):
        self.num_programs += 1  # programs dispatched (``num_programs``)
        return program(*args)

    def _no_tokens(self) -> jax.Array:
        """i32[W] zeros on the device: the step before's tokens when there are none to fill."""
        if self._zeros is None:
            self._zeros = self._put(np.zeros(self.fill_width, np.int32))
        return self._zeros

    # ---- warm-up ---------------------------------------------------------------------------

    def step_shapes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
        return self.batcher.step_shapes(max_num_seqs, max_num_batched_tokens)

    def warmup(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        swap: bool | None = None,
        progress: bool = True,
    ) -> WarmupReport:
        """Compile every program a workload within these limits can need (``warmup_jobs``: the
        program set's bound) on a thread pool (XLA compiles outside the GIL); returns the
        seconds each program took (compiled, or loaded from the persistent cache)."""
        limits = (max_num_seqs, max_num_batched_tokens)
        jobs = self.warmup_jobs(*limits, swap=swap)
        logger.info("warm-up: the engine's whole program set, %d programs", len(jobs))
        executables.warn_if_unsafe(len(jobs))
        return self.compile(jobs, progress=progress)

    def program_bound(self, max_num_seqs: int, max_num_batched_tokens: int, swap=None) -> int:
        """The most programs this runner's steps can compile within these limits (the warm-up's
        job count; worker/warmup_jobs.py lists them)."""
        return len(self.warmup_jobs(max_num_seqs, max_num_batched_tokens, swap=swap))

    def compile(self, jobs: list[Job], **kwargs) -> WarmupReport:
        """Compile ``jobs`` (worker/warmup.py's ``compile_jobs``, which takes ``kwargs``) and
        count what they compiled as this runner's; safe on a thread beside the engine's."""
        report = compile_jobs(jobs, guard=self.calls.guard, **kwargs)
        self.calls.count(report.num_compiled, report.compile_seconds)
        self.calls.warmed_up = True
        return report

    def startup_jobs(self, *limits, default=warmup_jobs.DEFAULT_SAMPLING) -> list[Job]:
        """The programs a server compiles before it answers within ``limits`` (max_num_seqs,
        max_num_batched_tokens) for requests that sample as ``default`` (worker/warmup_jobs.py)."""
        return warmup_jobs.startup_jobs(self, *limits, default)

    def warmup_jobs(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        swap: bool | None = None,
    ) -> list[Job]:
        """Every program a workload within these limits can need (worker/warmup_jobs.py), as
        (name, lowering thunk); the async placeholders' fill is in the step program."""
        return warmup_jobs.warmup_jobs(self, max_num_seqs, max_num_batched_tokens, swap)

    def place(self, tree):
        """Host arrays to the device, placed as every program's inputs are (not counted)."""
        return jax.device_put(tree, self._inputs)

    # ---- block moves (before the step that needs them) ------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer."""
        self._call("copy", *padded_ids(pairs))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for every layer."""
        if not self.num_host_blocks:
            raise ValueError("no host swap space: set swap_space_gib > 0 to swap")
        self._call("swap_out", *padded_ids(pairs))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for every layer."""
        self._call("swap_in", *padded_ids(pairs))

    def forward_logits(self, seqs: list[ScheduledSeq], all_positions: bool = False) -> np.ndarray:
        """Logits for the last token of each sequence, or for every scheduled token (testing and
        scoring); writes the tokens' K/V into the pool like a normal step."""
        step_input = self.build_step_input(seqs)
        lengths = np.asarray([len(s.token_ids) for s in seqs])
        rows = np.arange(lengths.sum()) if all_positions else np.cumsum(lengths) - 1
        step_input = step_input.replace(logits_indices=rows.astype(np.int32))
        return np.asarray(self._call("run_forward", step_input))

    def forward(self, seqs: list[ScheduledSeq]) -> jax.Array:
        """The model step alone, with execute's (bucketed, warmed-up) program: writes the tokens'
        K/V and returns, on the device, the logits of each sequence's last token (row i: seq i)."""
        return self._call("run_forward", self.build_step_input(seqs), True)

    def _step_operands(self, packed, prev_tokens, layout) -> tuple:
        """``programs.step``'s operands: this step's packed inputs and previous tokens, the
        runner's weights, pool and static settings."""
        return (
            self.params,
            self.kv_cache.pages,
            self._host(packed),
            prev_tokens,
            self.config,
            self.backend,
            self.mesh,
            self.linear,
            layout,
            self.lora_slots,
        )

    def _run_forward(self, step_input: StepInput, bucketed: bool = False) -> jax.Array:
        if bucketed:  # the step program (warmed up), its logits rows all read
            rows = np.arange(len(step_input.logits_indices), dtype=np.int32)
            packed, layout = step_program.pack_inputs(step_input, rows)
            outs, self.kv_cache.pages = programs.step(
                *self._step_operands(packed, self._no_tokens(), layout)
            )
            return outs["logits"]
        logits, self.kv_cache.pages = programs.forward(
            self.params,
            self.kv_cache.pages,
            jax.device_put(step_input, self._inputs),
            self.config,
            self.backend,
            self.mesh,
            self.linear,
            self.lora_slots,
        )
        return logits

    # ---- multi-process ---------------------------------------------------------------------

    def device_op(self, op: str):
        """The function behind device operation ``op`` (None for another message), run here
        alone: no follower sees it, no compile is counted, no observer called."""
        ops = {
            "run_step": self._run_step,
            "run_forward": self._run_forward,
            "copy": self.kv_cache.copy,
            "swap_out": self.kv_cache.swap_out,
            "swap_in": self.kv_cache.swap_in,
            "load_lora": self._load_lora,
        }
        return ops.get(op)

    def _call(self, op: str, *args):
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
        self.kv_cache.free()
