"""What the engine needs of a model runner, as one protocol: the step loop's step path and block
moves (engine/step_loop.py, worker/kv_cache.py's ``apply_block_moves``), a server's start
(compiling: engine/hosting/startup.py), the figures that inspection and the stats read, and the
multi-process side (pagedjax/distributed.py). ``Runner`` (worker/runner.py), the draft model's
``DraftModelRunner`` (spec_decode/draft.py) and the tests' fake model implement it; nothing
probes a runner for what it has."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pagedjax.distributed import Channel
from pagedjax.models.config import ModelConfig
from pagedjax.worker.input_batch import ScheduledSeq, StepShape
from pagedjax.worker.kv_cache import KVCache
from pagedjax.worker.lora import RunnerLoRA
from pagedjax.worker.sampler import Variant
from pagedjax.worker.step_handle import StepOutput
from pagedjax.worker.warmup import Job, WarmupReport


@runtime_checkable
class ModelRunner(Protocol):
    config: ModelConfig  # the model's (its vocabulary: the sampler's width)
    params: object  # the weights (a pytree; None once freed)
    kv_cache: KVCache | None  # the device pool (None: a runner without one, the tests' fake)
    lora: RunnerLoRA | None  # the adapters' device slots (None: no LoRA)
    channel: Channel | None  # a multi-process run's (None: one process)

    # ---- the step path ----------------------------------------------------------------------

    @property
    def dispatches_ahead(self) -> bool:
        """Whether ``dispatch`` takes the step before's device tokens (async scheduling)."""
        ...

    def dispatch(self, seqs: list[ScheduledSeq], num_top_logprobs: int = 0, *, prev_tokens=None):
        """Start a step; its handle, for ``fetch``."""
        ...

    def fetch(self, handle) -> StepOutput: ...

    def execute(self, seqs: list[ScheduledSeq], num_top_logprobs: int = 0) -> StepOutput:
        """Run a step and wait for it."""
        ...

    # ---- block moves, before the step that needs them ---------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    def swap_out(self, pairs: list[tuple[int, int]]) -> None: ...

    def swap_in(self, pairs: list[tuple[int, int]]) -> None: ...

    def synchronize(self) -> None: ...

    # ---- compiling ------------------------------------------------------------------------

    @property
    def num_compilations(self) -> int: ...

    @property
    def compile_seconds(self) -> float: ...

    @property
    def shapes_built(self) -> list[StepShape]:
        """The step shapes the steps have used (the background compile starts near them)."""
        ...

    def warmup_jobs(
        self, max_num_seqs: int, max_num_batched_tokens: int, *, swap: bool | None = None
    ) -> list[Job]:
        """The program set within these limits."""
        ...

    def startup_jobs(
        self, max_num_seqs: int, max_num_batched_tokens: int, *, default: Variant | None
    ) -> list[Job]:
        """The programs a server compiles before it answers."""
        ...

    def compile(self, jobs: list[Job], **kwargs) -> WarmupReport: ...

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, **kwargs) -> WarmupReport:
        """Compile the whole program set."""
        ...

    # ---- processes ------------------------------------------------------------------------

    def follow(self) -> tuple[str, object]:
        """Follower: replay the driver's device operations until another message."""
        ...

    def free_device_memory(self) -> None:
        """Free the pool and the weights: the runner is unusable afterwards."""
        ...
