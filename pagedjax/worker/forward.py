"""The model step alone, outside the step path: the logits of chosen rows (tests, scoring, the
memory benchmark) and the draft model's steps (spec_decode/draft.py). A device operation of the
runner (``run_forward``): replayed by a multi-process run's followers, its compiles counted."""

from __future__ import annotations

import jax
import numpy as np

from pagedjax.models.step_input import StepInput
from pagedjax.worker import programs, step_program
from pagedjax.worker.input_batch import ScheduledSeq
from pagedjax.worker.lora import slots_of


class ModelForward:
    """``runner``'s model step without sampling (a worker/runner.py Runner)."""

    def __init__(self, runner):
        self.runner = runner

    def logits(self, seqs: list[ScheduledSeq], all_positions: bool = False) -> np.ndarray:
        """Logits for the last token of each sequence, or for every scheduled token; writes the
        tokens' K/V into the pool like a normal step."""
        step_input = self.runner.build_step_input(seqs)
        lengths = np.asarray([len(s.token_ids) for s in seqs])
        rows = np.arange(lengths.sum()) if all_positions else np.cumsum(lengths) - 1
        step_input = step_input.replace(logits_indices=rows.astype(np.int32))
        return np.asarray(self.runner.device("run_forward", step_input))

    def bucketed(self, seqs: list[ScheduledSeq]) -> jax.Array:
        """With the steps' own (bucketed, warmed-up) program: writes the tokens' K/V and
        returns, on the device, the logits of each sequence's last token (row i: seq i)."""
        return self.runner.device("run_forward", self.runner.build_step_input(seqs), True)

    def run(self, step_input: StepInput, bucketed: bool = False) -> jax.Array:
        """The device operation (every process runs it)."""
        r, pool = self.runner, self.runner.kv_cache
        if bucketed:  # the step program (warmed up), its logits rows all read
            rows = np.arange(len(step_input.logits_indices), dtype=np.int32)
            packed, layout = step_program.pack_inputs(step_input, rows)
            ops = r.step_ops
            outs, pool.pages = programs.step(*ops.step_operands(packed, ops.no_tokens(), layout))
            return outs["logits"]
        args = (r.place(step_input), r.statics, slots_of(r.lora))
        logits, pool.pages = programs.forward(r.params, pool.pages, *args)
        return logits
