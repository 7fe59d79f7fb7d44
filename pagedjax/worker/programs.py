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

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pagedjax import compilation
from pagedjax.models.llama import forward as model_forward
from pagedjax.models.llama import head_logits
from pagedjax.models.lora_slots import LoRABatch
from pagedjax.worker import prompt_logprobs, step_program


def _model_step(
    params,
    kv_pool,
    step_input,
    config,
    backend,
    mesh,
    linear=None,
    lora_slots=None,
    return_hidden=False,
):
    # linear: the WeightLayout the parameters were processed for (models/linear.py)
    lora = None if lora_slots is None else LoRABatch(lora_slots, step_input.lora_slot)
    model = (config, backend, mesh, linear, lora, return_hidden)
    return model_forward(params, kv_pool, step_input, *model)


def _step_and_sample(
    params, kv_pool, packed, prev_tokens, config, backend, mesh, packed_w, layout, lora_slots=None
):
    # packed: i32[...], the step's inputs (step_program.pack_inputs); prev_tokens: i32[W], the
    # step before's tokens on the device (placeholders -1 - r read row r)
    step_input, logit_rows, sampling = step_program.unpack_inputs(packed, layout)
    filled = step_program.fill_tokens(step_input.token_ids, prev_tokens)
    step_input = step_input.replace(token_ids=filled)
    model = (config, backend, mesh, packed_w, lora_slots, True)
    logits, kv_pool, hidden = _model_step(params, kv_pool, step_input, *model)
    outs = step_program.after_model(logits, logit_rows, prev_tokens, sampling)
    if mesh is not None:  # replicated, as the score program's inputs are placed
        hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, PartitionSpec()))
    outs["hidden"] = hidden  # [num_tokens, hidden]: prompt logprobs score rows of it
    return outs, kv_pool


def _score_rows(params, hidden, rows, targets, config, mesh, linear):
    # hidden: [num_tokens, hidden] a step's; rows, targets: i32[C], the rows to score and the
    # prompt token each predicts
    logits = head_logits(params, hidden[rows], config, None, mesh, linear)
    return prompt_logprobs.score(logits, targets)


# (params, pool, packed inputs, prev tokens, config, backend, mesh, weight layout, StepLayout,
# LoRA slots or None) -> (outputs, pool), the pool donated.
step = jax.jit(_step_and_sample, static_argnums=(4, 5, 6, 7, 8), donate_argnums=(1,))
# (logits rows, packed sampling, its layout, W) -> (packed output, tokens i32[W]).
sample = jax.jit(step_program.sample_program, static_argnums=(2, 3))
# (params, hidden, rows, targets, config, mesh, weight layout) -> PromptLogprobsOutput.
score = jax.jit(_score_rows, static_argnums=(4, 5, 6))
# (params, pool, StepInput, config, backend, mesh, weight layout, LoRA slots or None)
# -> (logits, pool).
forward = jax.jit(_model_step, static_argnums=(3, 4, 5, 6), donate_argnums=(1,))

compilation.track_compile_seconds()
