"""PEFT LoRA adapters made locally for the tests: random A and non-zero random B (PEFT starts B at
zero, which would make every adapter the base model)."""

from __future__ import annotations

import copy


def save_random_adapter(hf, directory, seed: int, **lora_config):
    """Save an adapter of ``lora_config`` (peft.LoraConfig's fields; no dropout) on a copy of
    ``hf`` to ``directory``; returns transformers' model with it merged into that copy
    (``merge_and_unload``, eval mode): the oracle of requests under the adapter."""
    import peft
    import torch

    config = peft.LoraConfig(lora_dropout=0.0, **lora_config)
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(directory))
    return model.merge_and_unload().eval()
