"""What ``Runner.dispatch`` returns (a step still on the device) and what ``fetch`` /
``execute`` return (its output on the host)."""

from __future__ import annotations

import dataclasses

import jax

from pagedjax.worker.input_batch import ScheduledSeq
from pagedjax.worker.prompt_logprobs import PromptLogprobsOutput, PromptScores
from pagedjax.worker.sampler import SamplerOutput


@dataclasses.dataclass
class StepHandle:
    """A dispatched step (``Runner.dispatch``): its outputs still on the device."""

    # i32[sampler rows, 2 + 2K] (step_program.pack_output), being copied to the host; a
    # VerifyOutput of device arrays in a step that verifies proposals
    out: object
    tokens: jax.Array | None  # i32[W]: the sampled tokens on the device (the next prev_tokens)
    scored: PromptLogprobsOutput | None
    seqs: list[ScheduledSeq]
    num_rows: int  # real sampler rows
    num_top_logprobs: int
    kind: str  # the step's kind in the profile: prefill, mixed or decode


@dataclasses.dataclass
class StepOutput:
    """A step's output on the host (``Runner.fetch`` / ``execute``)."""

    # one row per requested sample, sequence by sequence (a VerifyOutput in a step that
    # verifies proposals)
    sampled: SamplerOutput
    # the prompt rows the step scored, per scheduled sequence that had any (prompt logprobs)
    prompt_scores: list[PromptScores] = dataclasses.field(default_factory=list)
