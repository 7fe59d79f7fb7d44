"""Tiny random models with PEFT adapters for the engine's LoRA oracle tests: each adapter saved
with random A and non-zero random B (PEFT starts B at zero), and transformers' model with it
merged into its own copy of the base (``merge_and_unload``), the oracle of its requests."""

from __future__ import annotations

from pathlib import Path

from hf_models import make_tiny_model, save_word_tokenizer
from peft_adapters import save_random_adapter

from pagedjax import LoRARequest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, rslora, target modules): different ranks, scalings and targets.
SPECS = [
    (4, 8, False, ["q_proj", "v_proj"]),
    (8, 32, True, ALL),
    (16, 16, False, ["o_proj", "gate_proj", "down_proj"]),
    (8, 16, False, ["k_proj", "up_proj"]),
]


def save_adapter(hf, spec, directory: Path, seed: int):
    """Save a PEFT adapter of ``spec`` with random A and B on a copy of ``hf``; returns
    transformers' model with it merged (eval mode, generating without EOS stops)."""
    rank, alpha, rslora, modules = spec
    merged = save_random_adapter(
        hf, directory, seed, r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=modules
    )
    merged.generation_config.eos_token_id = None
    return merged


def build(name: str, root: Path, num_adapters: int = 3):
    """(base dir, HF models [base, adapter 1, ...], LoRARequests [adapter 1, ...])."""
    hf = make_tiny_model(name, root / "base")
    save_word_tokenizer(root / "base")
    hf.generation_config.eos_token_id = None
    models, requests = [hf], []
    for i, spec in enumerate(SPECS[:num_adapters], start=1):
        models.append(save_adapter(hf, spec, root / f"adapter{i}", seed=i))
        requests.append(LoRARequest(f"{name}-adapter{i}", i, str(root / f"adapter{i}")))
    return str(root / "base"), models, requests
