"""A step's device operation (``run_step``, through the runner's door: worker/device_calls.py):
which programs run, on what, each host array's transfer and each program's launch counted.

The step program (async scheduling's token fill, the model, and the sampling of a plain greedy
batch or, its input packed with the step's, of a sampled decode step); else the sampler program
unless the batch is plain greedy; the verify program in a step that verifies proposals
(``pagedjax.worker.rejection``); the score program for each chunk of prompt rows
(worker/prompt_logprobs.py).
"""

from __future__ import annotations

import jax
import numpy as np

from pagedjax.worker import programs, step_program
from pagedjax.worker.lora import slots_of
from pagedjax.worker.rejection import verify_step
from pagedjax.worker.sampler import SamplingInput


class StepOps:
    """``runner``'s step programs (a worker/runner.py Runner: its weights, pool, LoRA slots and
    static settings); ``placement``: where every program's host inputs go."""

    def __init__(self, runner, placement):
        self.runner = runner
        self.placement = placement
        self.num_programs = 0  # programs the steps dispatched
        self.num_transfers = 0  # host arrays the steps sent to the device
        self._zeros = None

    def run_step(
        self,
        packed: np.ndarray,
        layout: step_program.StepLayout,
        sampling: SamplingInput | None,
        drafts: np.ndarray | None = None,
        draft_probs: np.ndarray | None = None,
        score_chunks: list[tuple[np.ndarray, np.ndarray]] = (),
        prev_tokens: jax.Array | None = None,
    ):
        """One step's programs (module docstring). Returns (output, tokens i32[W] or None, the
        chunks' scores), on the device."""
        r = self.runner
        if prev_tokens is None:
            prev_tokens = self.no_tokens()
        outs, r.kv_cache.pages = self.launch(
            programs.step, *self.step_operands(packed, prev_tokens, layout)
        )
        model = (r.config, r.mesh, r.linear)
        scored = [
            self.launch(programs.score, r.params, outs["hidden"], *self.put(chunk), *model)
            for chunk in score_chunks
        ]
        if drafts is not None:
            # Speculation: rows with a proposal verify it (VerifyOutput: SamplerOutput +
            # accepted); the logits rows are the sampler's already.
            rows = np.arange(layout.num_logits, dtype=np.int32)
            args = (outs["logits"], *self.put((rows, sampling, drafts)))
            if draft_probs is not None:
                args += (self.put(draft_probs),)
            return self.launch(verify_step, *args), None, scored
        # A plain greedy batch (None: nothing built for it) or a sampled decode step (its
        # sampling input in the layout) is sampled in the step program.
        if sampling is None:
            return outs["packed"], outs["tokens"], scored
        packed_sampling, sampling_layout = step_program.pack_sampling(sampling)
        args = (outs["logits"], self.put(packed_sampling), sampling_layout, r.fill_width)
        return *self.launch(programs.sample, *args), scored

    def step_operands(self, packed, prev_tokens, layout) -> tuple:
        """``programs.step``'s operands: this step's packed inputs and previous tokens, the
        runner's weights, pool and static settings."""
        r = self.runner
        pool = r.kv_cache.pages
        return (r.params, pool, self.host(packed), prev_tokens, r.statics, layout, slots_of(r.lora))

    def host(self, packed: np.ndarray) -> np.ndarray:
        """A step's packed inputs, handed to the step program as a host array (counted: one
        transfer): jit's own transfer costs a fraction of a ``device_put`` before the call, and
        the program is lowered for a host array (worker/warmup_jobs.py), so it is the same one."""
        self.num_transfers += 1
        return packed

    def put(self, tree):
        """Host arrays to the device (counted: ``num_transfers``, one per array)."""
        self.num_transfers += len(jax.tree.leaves(tree))
        return jax.device_put(tree, self.placement)

    def launch(self, program, *args):
        self.num_programs += 1
        return program(*args)

    def no_tokens(self) -> jax.Array:
        """i32[W] zeros on the device: the step before's tokens when there are none to fill."""
        if self._zeros is None:
            self._zeros = self.put(np.zeros(self.runner.fill_width, np.int32))
        return self._zeros
