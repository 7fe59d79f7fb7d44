"""Tiny random-weight Hugging Face models for oracle tests (saved with save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedjax.bench import serve_model, tiny

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
# One per family beyond the Llama ones above (tests/models/test_families*.py): each exercises
# the family's defining details. Windows of 8 tokens, so that test prompts run past them.
WINDOW = 8
_GEMMA = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
    hidden_activation="gelu_pytorch_tanh",
)
FAMILY_CONFIGS = {
    "qwen3": (  # q/k norms; Qwen's optional window on the layers from max_window_layers on
        "Qwen3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
    ),
    "gemma2": (  # soft caps small enough to bend the logits
        "Gemma2Config",
        dict(
            **_GEMMA, num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
        ),
    ),
    "gemma3": (  # local/global layers with their own rope; linear scaling on the global ones
        "Gemma3TextConfig",
        dict(
            **_GEMMA,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4),
    ),
    "qwen2_moe": (  # shared expert; layer 1 dense (mlp_only_layers)
        "Qwen2MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (  # every second layer sparse (decoder_sparse_step)
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "phi3": (  # LongRoPE past 32 tokens, partial rotary (half the head)
        "Phi3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=32,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 4.0, 9.0, 16.0],
            },
            pad_token_id=0,
        ),
    ),
    "mistral_window": (
        "MistralConfig",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW),
    ),
    "opt": (  # OPT-125m style: pre-norm
        "OPTConfig",
        dict(num_attention_heads=4, ffn_dim=128, pad_token_id=0),
    ),
    "opt_post_norm": (  # OPT-350m style: post-norm, embeddings projected in and out
        "OPTConfig",
        dict(
            num_attention_heads=4,
            ffn_dim=128,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
            pad_token_id=0,
        ),
    ),
}
_ARCH = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "Gemma2Config": "Gemma2ForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
    "MixtralConfig": "MixtralForCausalLM",
    "Qwen2MoeConfig": "Qwen2MoeForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "Phi3Config": "Phi3ForCausalLM",
    "OPTConfig": "OPTForCausalLM",
}


def tiny_config(name: str, **overrides):
    """The transformers config of tiny model ``name``."""
    import transformers

    cls_name, kwargs = {**TINY_CONFIGS, **FAMILY_CONFIGS}[name]
    base = dict(tiny.BASE)
    if cls_name == "OPTConfig":  # OPT's names for the same things
        base["ffn_dim"] = base.pop("intermediate_size")
        base["init_std"] = base.pop("initializer_range")
        base.pop("rms_norm_eps")
        base["bos_token_id"], base["eos_token_id"] = 2, 2
    config = getattr(transformers, cls_name)(**{**base, **kwargs, **overrides})
    config._attn_implementation = "eager"  # the reference softmax (soft caps, windows)
    return config


def save_tiny_config(name: str, directory: Path, **overrides) -> None:
    """Only the config.json of tiny model ``name`` (no weights: cheap)."""
    tiny_config(name, **overrides).save_pretrained(directory)


def make_tiny_model(name: str, directory: Path, seed: int = 0, **overrides):
    """Build, randomise (biases too) and save a tiny model; returns the torch model in eval mode."""
    config = tiny_config(name, **overrides)
    return tiny.build(config, directory, seed, _ARCH[type(config).__name__])


def save_word_tokenizer(
    directory: Path, vocab_size: int = 256, chat_template: str | None = None
) -> None:
    """A word-level tokenizer (token i <-> word "w{i}"; 0, 1, 2 are <unk>, <s>, </s>) so that
    tiny models can detokenise; ``chat_template`` (jinja) is saved with it if given."""
    serve_model.save_word_tokenizer(directory, vocab_size, chat_template)


def tiny_llama_dir(
    tmp_path_factory, name: str, *, tokenizer: bool = False, chat_template: str | None = None
) -> str:
    """A fresh directory ``name`` holding the tiny "llama_gqa" model, with the word tokenizer
    (and ``chat_template``) when asked."""
    path = tmp_path_factory.mktemp(name)
    make_tiny_model("llama_gqa", path)
    if tokenizer or chat_template is not None:
        save_word_tokenizer(path, chat_template=chat_template)
    return str(path)


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``max_tokens`` long: EOS may be chosen,
    never stops (like ignore_eos; the model's generation config is changed to that)."""
    import torch

    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
        outs.append(ids[0, len(p) :].tolist())
    return outs


def random_prompts(
    n: int,
    seed: int,
    lo: int = 1,
    hi: int = 40,
    prefix: list[int] | None = None,
    vocab: int = 256,
) -> list[list[int]]:
    """``n`` prompts of ids in [3, vocab) (no special token), lengths drawn from [lo, hi), each
    after ``prefix``."""
    rng = np.random.default_rng(seed)
    return [
        (prefix or []) + rng.integers(3, vocab, int(rng.integers(lo, hi))).tolist()
        for _ in range(n)
    ]


def tiny_llama_hf(tmp_path_factory, name: str):
    """(directory, torch model) of the tiny "llama_gqa" model with the word tokenizer; the torch
    model's generation never stops on EOS (like ``ignore_eos``)."""
    path = tmp_path_factory.mktemp(name)
    hf = make_tiny_model("llama_gqa", path)
    save_word_tokenizer(path)
    hf.generation_config.eos_token_id = None
    return str(path), hf


def speculation_prompts(lens: list[int], seed: int) -> list[list[int]]:
    """One prompt of random ids in [3, 256) per length in ``lens``, then one that repeats itself
    (n-gram lookup and a draft propose from it)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lens] + [[17, 40, 93, 7, 250, 61] * 4]
