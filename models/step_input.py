"""StepInput: everything one jitted model step needs about the batch, as one pytree.

Built once per step on the host (pagedjax/runner.py), padded to shape buckets. Padding tokens have
slot -1 (their K/V is dropped); padding sequences have context length 0 and no query rows.
``lora_slot`` is there only when the engine serves LoRA adapters (None otherwise: a step without
adapters is the same program as before they existed).
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class StepInput:
    token_ids: jax.Array  # i32[num_tokens]
    positions: jax.Array  # i32[num_tokens]
    slot_mapping: jax.Array  # i32[num_tokens], -1 = padding
    block_tables: jax.Array  # i32[num_seqs, max_blocks], padded with the null block 0
    context_lens: jax.Array  # i32[num_seqs], tokens in the pool after this step's writes
    query_start_loc: jax.Array  # i32[num_seqs + 1], seq i owns rows [qsl[i], qsl[i+1])
    logits_indices: jax.Array  # i32[num_logits], token rows whose logits are returned
    max_query_len: int = struct.field(pytree_node=False)  # static bound on any seq's rows
    # i32[num_tokens]: each token row's LoRA slot (0 = base model, padding rows 0); None: no LoRA
    lora_slot: jax.Array | None = None
