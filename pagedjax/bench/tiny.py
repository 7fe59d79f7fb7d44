"""Tiny random-weight Hugging Face models, saved with ``save_pretrained``: the one builder that
the tests (as oracles), the benchmarks' smoke runs, the notebooks and the device check share.
Needs torch and transformers (imported when called)."""

from __future__ import annotations

from pathlib import Path

# The dimensions every tiny model starts from (a family's config adds its own settings).
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    initializer_range=0.15,  # wide logits: greedy ties are unlikely
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
)


def llama_config(**overrides):
    """A tiny Llama (4 heads, 2 KV heads) config; ``overrides`` replace any field."""
    import transformers

    kwargs = {**BASE, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides}
    return transformers.LlamaConfig(**kwargs)


def build(config, directory: str | Path, seed: int = 0, model_class: str | None = None):
    """A random model of ``config`` (biases and norm scales randomised too, which HF initialises
    to 0 and 1), saved under ``directory``; returns the torch model in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if model_class is None:
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = getattr(transformers, model_class)(config)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    return model


def tiny_llama(directory: str | Path, seed: int = 0, **overrides):
    """``build(llama_config(**overrides), directory, seed)``."""
    return build(llama_config(**overrides), directory, seed)
