"""Draft-model speculation: a smaller model with the target's vocabulary proposes, the target
verifies (``{"method": "draft_model", "model": path, "num_speculative_tokens": k}``).

Design: one shared mapping. The draft model has a paged pool of its own with the target's
geometry (as many blocks, the same block size; its own layers, heads and dtype), read through
the target's block tables as they are: physical block b holds the same tokens in both pools. So
the one block manager serves both. Every block move (copy-on-write, swap out, swap in) is applied
to both pools, and the draft computes every token the target computes, in the same step (the
"mirror": the draft model runs over the step's own tokens, positions and tables), so a block's
K/V is valid in both pools at once: prefix-cache hits, recomputation and swaps need nothing more,
and rejected slots are overwritten in both pools alike.

A step with proposals (the scheduler has given each speculated sequence p lookahead slots and p
placeholder proposals, ``speculator.PlaceholderProposer``), in ``DraftModelRunner.execute``:

1. propose: p decode steps of the draft model over the speculated sequences. Step j feeds the
   token before (the sequence's last token, then its drafts so far) at its position and draws
   draft j + 1 from the draft's distribution q under the request's own sampling settings (the
   argmax for a greedy request; key ``fold_in(row key, 3)``). Their K/V goes to the lookahead
   slots of the draft's pool. The drafts replace the placeholders (and fill penalties' histories);
2. mirror: the draft model computes the step's tokens into its pool;
3. verify: the target's step, with q on every proposal's row (rejection sampling: accept with
   min(1, p / q), else draw from the residual max(0, p - q)).

Programs: the draft's own step programs (the same shape buckets as the target's), its sampler
program ``draft_sample`` per decode sequence bucket, and the target's verify program with q; all
compiled by ``warmup``. q comes back to the host to be placed on the proposals' rows (vocab floats
per proposal and step). One process and one device only (no tensor parallelism) for now; the
draft's pool is allocated on top of the target's (size the target's pool to leave room).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import compilation
from pagedjax.models.loader import load_model
from pagedjax.worker.input_batch import ScheduledSeq
from pagedjax.worker.runner import Runner, RunnerConfig, WarmupReport
from pagedjax.worker.sampler import (
    SamplingInput,
    SamplingRow,
    argmax,
    process_logits,
    row_keys,
)
from pagedjax.worker.warmup import Job, compile_jobs

DRAFT_KEY = 3  # folded into a row's key for the draft's own draws


@jax.jit
def draft_sample(logits: jax.Array, s: SamplingInput) -> tuple[jax.Array, jax.Array]:
    """logits f32[rows, vocab] -> (proposals i32[rows], q f32[rows, vocab]): each row's draft,
    drawn from q, the draft's distribution under the row's settings (greedy rows: its argmax)."""
    x = process_logits(logits.astype(jnp.float32), s)  # [rows, vocab]
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
        row_keys(s.seeds, s.positions), DRAFT_KEY
    )
    sampled = jax.vmap(jax.random.categorical)(keys, x)
    tokens = jnp.where(s.temperature > 0, sampled, argmax(x))
    return tokens.astype(jnp.int32), jax.nn.softmax(x, axis=-1)


def _fill_history(row: SamplingRow, drafts: list[int]) -> None:
    """A penalised row's output history ends with the placeholders of the drafts before it."""
    n = len(drafts)
    if n and row.output_token_ids:
        row.output_token_ids = [*row.output_token_ids[: len(row.output_token_ids) - n], *drafts]


class DraftModelRunner:
    """The target's Runner with the draft model's beside it (see the module docstring): a
    ModelRunner (worker/runner_protocol.py) whose steps are the target's, preceded by the
    draft's proposals and mirror; its pool, weights, adapters and counts are the target's
    (the draft's compiles counted too)."""

    def __init__(self, target: Runner, draft: Runner):
        if target.channel is not None or target.mesh is not None:
            raise ValueError(
                "draft_model speculation runs on one process and one device for now "
                "(no tensor parallelism, no multi-process run)"
            )
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the "
                f"target's ({target.config.vocab_size})"
            )
        self.target = target
        self.draft = draft
        self.config, self.lora, self.channel = target.config, target.lora, None
        self.num_own_compilations = 0  # draft_sample programs
        self.own_compile_seconds = 0.0
        target.verifies_draft_probs = True

    @property
    def params(self):
        return self.target.params

    @property
    def kv_cache(self):
        return self.target.kv_cache

    # A step checks the proposals with their q: it waits for the draft's, never dispatched ahead.
    dispatches_ahead = False

    @property
    def num_compilations(self) -> int:
        own = self.num_own_compilations
        return self.target.num_compilations + self.draft.num_compilations + own

    @property
    def compile_seconds(self) -> float:
        own = self.own_compile_seconds
        return self.target.compile_seconds + self.draft.compile_seconds + own

    @property
    def shapes_built(self) -> list:
        return self.target.shapes_built

    # ---- a step --------------------------------------------------------------------------

    def execute(self, seqs: list[ScheduledSeq], num_top_logprobs: int = 0):
        # Steps with a query longer than one token verify, with q (zeros where none proposed).
        probs = self._propose(seqs) if max(len(s.token_ids) for s in seqs) > 1 else None
        self.draft.forward([ScheduledSeq(s.token_ids, s.start_pos, s.block_table) for s in seqs])
        return self.target.execute(seqs, num_top_logprobs, draft_probs=probs)

    def dispatch(self, seqs: list[ScheduledSeq], num_top_logprobs: int = 0, prev_tokens=None):
        """Runs the step at once (``dispatches_ahead`` is False: no step before's tokens)."""
        if prev_tokens is not None:
            raise ValueError("prev_tokens: a draft model's steps are not dispatched ahead")
        return self.execute(seqs, num_top_logprobs)

    def fetch(self, handle):
        return handle  # execute's output already

    def _propose(self, seqs: list[ScheduledSeq]) -> np.ndarray:
        """Write each speculated sequence's drafts over its placeholders; returns q on the
        proposals' sampler rows (f32[rows, vocab], zeros elsewhere)."""
        size = len(self.target.build_step_input(seqs).logits_indices)
        probs = np.zeros((size, self.target.config.vocab_size), np.float32)
        first_row = np.cumsum([0] + [len(s.samples) for s in seqs])
        live = [i for i, s in enumerate(seqs) if s.num_spec_tokens]
        for j in range(max((seqs[i].num_spec_tokens for i in live), default=0)):
            live = [i for i in live if seqs[i].num_spec_tokens > j]
            batch, rows = [], []
            for i in live:
                s = seqs[i]
                own = len(s.token_ids) - s.num_spec_tokens  # the sequence's own tokens
                _fill_history(s.samples[j], s.token_ids[own : own + j])
                # Feed the token before draft j + 1 at its position; its K/V goes to the pool.
                batch.append(
                    ScheduledSeq(
                        [s.token_ids[own - 1 + j]], s.start_pos + own - 1 + j, s.block_table
                    )
                )
                rows.append(s.samples[j])
            tokens, q = self._sample(self.draft.forward(batch), rows)
            for b, i in enumerate(live):
                s = seqs[i]
                s.token_ids[len(s.token_ids) - s.num_spec_tokens + j] = int(tokens[b])
                probs[first_row[i] + j] = q[b]
        for s in seqs:  # the bonus rows: every draft before them
            if s.num_spec_tokens:
                p = s.num_spec_tokens
                _fill_history(s.samples[p], s.token_ids[len(s.token_ids) - p :])
        return probs

    def _sample(self, logits: jax.Array, rows: list[SamplingRow]):
        sampling = SamplingInput.build(
            rows,
            logits.shape[0],
            self.target.config.vocab_size,
            history_width=self.target.max_model_len,
        ).without_flags()
        before = compilation.this_thread()[0]
        tokens, q = draft_sample(logits, self.target.place(sampling))
        tokens, q = np.asarray(tokens), np.asarray(q)
        self.num_own_compilations += compilation.this_thread()[0] - before
        return tokens, q

    # ---- block moves: both pools ---------------------------------------------------------

    def copy_blocks(self, pairs):
        self.target.copy_blocks(pairs)
        self.draft.copy_blocks(pairs)

    def swap_out(self, pairs):
        self.target.swap_out(pairs)
        self.draft.swap_out(pairs)

    def swap_in(self, pairs):
        self.target.swap_in(pairs)
        self.draft.swap_in(pairs)

    def synchronize(self) -> None:
        self.target.synchronize()
        self.draft.synchronize()

    def free_device_memory(self) -> None:
        """Both runners' pools and weights."""
        self.target.free_device_memory()
        self.draft.free_device_memory()

    def follow(self):
        raise RuntimeError("draft_model speculation runs in one process: nothing to follow")

    # ---- compiling -----------------------------------------------------------------------

    def warmup_jobs(
        self, max_num_seqs: int, max_num_batched_tokens: int, *, swap: bool | None = None
    ) -> list[Job]:
        """Both runners' program sets, then ``draft_sample`` for each decode sequence bucket
        (with and without penalties, with and without a constraint)."""
        limits = (max_num_seqs, max_num_batched_tokens)
        jobs = self.target.warmup_jobs(*limits, swap=swap)
        jobs += [
            (f"draft {name}", lower) for name, lower in self.draft.warmup_jobs(*limits, swap=swap)
        ]
        shapes = self.draft.batcher.step_shapes(*limits)
        for s in sorted({shape.num_seqs for shape in shapes if shape.max_query_len == 1}):
            for penalties, constrained in itertools.product((False, True), (False, True)):
                name = f"draft_sample s{s}" + " penalties" * penalties
                lower = functools.partial(self._lower_sample, s, penalties, constrained)
                jobs.append((name + " constrained" * constrained, lower))
        return jobs

    def startup_jobs(
        self, max_num_seqs: int, max_num_batched_tokens: int, *, default=None
    ) -> list[Job]:
        """Every program: a draft model's server compiles its whole set before it answers."""
        return self.warmup_jobs(max_num_seqs, max_num_batched_tokens)

    def compile(self, jobs: list[Job], **kwargs) -> WarmupReport:
        """Compile ``jobs`` (worker/warmup.py's ``compile_jobs``), counted as this runner's."""
        report = compile_jobs(jobs, guard=self.target.calls.guard, **kwargs)
        self.num_own_compilations += report.num_compiled
        self.own_compile_seconds += report.compile_seconds
        self.target.calls.warmed_up = self.draft.calls.warmed_up = True
        return report

    def warmup(
        self, max_num_seqs: int, max_num_batched_tokens: int, *, swap=None, progress: bool = True
    ) -> WarmupReport:
        jobs = self.warmup_jobs(max_num_seqs, max_num_batched_tokens, swap=swap)
        return self.compile(jobs, progress=progress)

    def _lower_sample(self, num_seqs: int, penalties: bool, constrained: bool):
        row = SamplingRow(
            repetition_penalty=1.5 if penalties else 1.0,
            logit_bias=((0, 1.0),) if constrained else (),
        )
        vocab = self.target.config.vocab_size
        logits = self.target.place(np.zeros((num_seqs, vocab), np.float32))
        sampling = SamplingInput.build(
            [row], num_seqs, vocab, history_width=self.target.max_model_len
        ).without_flags()
        return draft_sample.lower(logits, self.target.place(sampling))


def with_draft_model(config, runner):
    """The engine's runner: ``runner`` itself, or with a draft model beside it when the engine's
    speculative_config asks for one."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return runner
    if config.tensor_parallel_size != 1:
        raise ValueError("draft_model speculation does not support tensor_parallel_size > 1 yet")
    loaded = load_model(spec.model, dtype=config.dtype)
    if loaded.config.max_context_len < runner.max_model_len:
        raise ValueError(
            f"the draft model's context ({loaded.config.max_context_len} tokens) is shorter than "
            f"max_model_len={runner.max_model_len}"
        )
    sizes = RunnerConfig(
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        num_host_blocks=runner.num_host_blocks,
    )
    draft = Runner(loaded.config, loaded.params, sizes, backend=runner.backend)
    return DraftModelRunner(runner, draft)
