"""The runner's jitted programs, module-level so that engines with the same model and shapes share
compiled programs; static arguments are hashable configuration only (stable persistent-cache
keys). ``step``: a step's one program (async scheduling's token fill, the model, and the
sampling of a plain greedy batch or of a sampled decode step: worker/step_program.py);
``sample``: the sampler of the other batches that need more than greedy; ``score``: prompt
logprobs of rows of a step's hidden output (worker/prompt_logprobs.py); ``forward``: the model
step alone (logits of the rows asked). ``step`` and ``forward`` take the LoRA adapters' device
slots last (models/lora_slots.py), read by each token row's ``StepInput.lora_slot``: None (an
empty tree) without LoRA, which lowers the program of an engine without adapters unchanged."""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pagedjax import compilation, pallas_kernels
from pagedjax.models.config import ModelConfig
from pagedjax.models.linear import WeightLayout
from pagedjax.models.llama import forward as model_forward
from pagedjax.models.llama import forward_hidden, head_logits
from pagedjax.models.lora_slots import LoRABatch
from pagedjax.worker import prompt_logprobs, step_program


class ModelStatics(NamedTuple):
    """The model as the programs run it, one static argument (hashable configuration only):
    its config, the attention backend (an object, or a name), the tensor-parallel mesh (None:
    one device) and the layout the weights were processed for (models/linear.py; None: as
    loaded)."""

    config: ModelConfig
    backend: pallas_kernels.AttentionBackend | str | None = None
    mesh: jax.sharding.Mesh | None = None
    linear: WeightLayout | None = None


def _model_step(params, kv_pool, step_input, model: ModelStatics, lora_slots=None):
    lora = None if lora_slots is None else LoRABatch(lora_slots, step_input.lora_slot)
    return model_forward(params, kv_pool, step_input, *model, lora)


def _step_and_sample(params, kv_pool, packed, prev_tokens, model: ModelStatics, layout, slots=None):
    # packed: i32[...], the step's inputs (step_program.pack_inputs); prev_tokens: i32[W], the
    # step before's tokens on the device (placeholders -1 - r read row r); slots: the LoRA
    # adapters' device slots (None: no LoRA)
    step_input, logit_rows, sampling = step_program.unpack_inputs(packed, layout)
    filled = step_program.fill_tokens(step_input.token_ids, prev_tokens)
    step_input = step_input.replace(token_ids=filled)
    lora = None if slots is None else LoRABatch(slots, step_input.lora_slot)
    logits, kv_pool, hidden = forward_hidden(params, kv_pool, step_input, *model, lora)
    outs = step_program.after_model(logits, logit_rows, prev_tokens, sampling)
    mesh = model.mesh
    if mesh is not None:  # replicated, as the score program's inputs are placed
        hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, PartitionSpec()))
    outs["hidden"] = hidden  # [num_tokens, hidden]: prompt logprobs score rows of it
    return outs, kv_pool


def _score_rows(params, hidden, rows, targets, config, mesh, linear):
    # hidden: [num_tokens, hidden] a step's; rows, targets: i32[C], the rows to score and the
    # prompt token each predicts
    logits = head_logits(params, hidden[rows], config, None, mesh, linear)
    return prompt_logprobs.score(logits, targets)


# (params, pool, packed inputs, prev tokens, ModelStatics, StepLayout, LoRA slots or None)
# -> (outputs, pool), the pool donated.
step = jax.jit(_step_and_sample, static_argnums=(4, 5), donate_argnums=(1,))
# (logits rows, packed sampling, its layout, W) -> (packed output, tokens i32[W]).
sample = jax.jit(step_program.sample_program, static_argnums=(2, 3))
# (params, hidden, rows, targets, config, mesh, weight layout) -> PromptLogprobsOutput.
score = jax.jit(_score_rows, static_argnums=(4, 5, 6))
# (params, pool, StepInput, ModelStatics, LoRA slots or None) -> (logits, pool).
forward = jax.jit(_model_step, static_argnums=(3,), donate_argnums=(1,))

compilation.track_compile_seconds()
