"""Tiny random-weight Hugging Face models for oracle tests (saved with save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (config class name, kwargs). Each exercises one family feature.
TINY_CONFIGS = {
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama3_rope_tied": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_scaling=LLAMA3_ROPE,
            tie_word_embeddings=True,
        ),
    ),
    "mistral": (
        "MistralConfig",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=None),
    ),
    "qwen2_bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_mqa": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0),
    ),
}
_ARCH = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
}


def make_tiny_model(name: str, directory: Path, seed: int = 0, **overrides):
    """Build, randomise (biases too) and save a tiny model; returns the torch model in eval mode."""
    import transformers

    cls_name, kwargs = TINY_CONFIGS[name]
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=1,
    )
    config = getattr(transformers, cls_name)(**{**base, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH[cls_name])(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:  # HF inits these to 0 / 1
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def save_word_tokenizer(
    directory: Path, vocab_size: int = 256, chat_template: str | None = None
) -> None:
    """A word-level tokenizer (token i <-> word "w{i}"; 0, 1, 2 are <unk>, <s>, </s>) so that
    tiny models can detokenise; ``chat_template`` (jinja) is saved with it if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
