"""The model registry: Hugging Face ``architectures`` / ``model_type`` -> family.

A family is a config-driven variant of the shared decoder (models/decoder.py): its entry here
reads the family's ``config.json`` fields into ModelConfig's keyword arguments (models/config.py
builds the config from them: ``ModelConfig.from_hf_dict``), and its name picks the HF weight map
(models/weight_maps.py). Adding a family is one parser and one weight map. This module imports
nothing of models/: the config reads it, not the other way round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# HF's layer_types entries (ModelConfig.layer_types holds them)
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architecture: str  # the HF class name our configs carry
    model_types: tuple[str, ...]
    fields: Callable[[dict[str, Any]], dict[str, Any]]  # HF config dict -> ModelConfig kwargs


def as_tuples(x):
    """Lists (a JSON round trip's, or HF's) as tuples, nested ones too: configs are hashable."""
    if isinstance(x, list):
        return tuple(as_tuples(v) for v in x)
    return x


def hashable_rope(rope: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    """Rope scaling parameters as sorted pairs, lists (longrope's factors) as tuples."""
    if rope.get("rope_type", "default") == "default":
        return None
    return tuple(sorted((k, as_tuples(v)) for k, v in rope.items()))


def _rope(d: dict[str, Any], params: dict[str, Any] | None = None) -> tuple[float, dict]:
    """(rope_theta, scaling dict without rope_theta) from transformers 5's rope_parameters or
    4.x's rope_theta + rope_scaling."""
    if params is None:
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope = dict(params)
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("partial_rotary_factor", None)  # read into rotary_dim
    return theta, rope


def _eos(d: dict[str, Any]) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _llama(d: dict[str, Any]) -> dict[str, Any]:
    """Fields every RoPE decoder shares (Llama's config layout)."""
    theta, rope = _rope(d)
    num_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
    bias = bool(d.get("attention_bias", False))
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size", 0),
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=hashable_rope(rope),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        sliding_window=d.get("sliding_window") or None,
        hidden_act=d.get("hidden_act", "silu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos(d),
    )


def _layer_types(d: dict[str, Any], default: Callable[[int], bool]) -> tuple[str, ...]:
    """``layer_types`` as saved (transformers 5), else from ``default(layer) -> sliding``."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    return tuple(SLIDING if default(i) else FULL for i in range(d["num_hidden_layers"]))


def _qwen_window(d: dict[str, Any], fields: dict[str, Any], slides=None) -> dict[str, Any]:
    """Qwen's optional sliding window, only with use_sliding_window: on the layers ``layer_types``
    names, else those ``slides(layer, max_window_layers)`` picks (HF's rule per family), else all.
    """
    if not d.get("use_sliding_window", False) or not d.get("sliding_window"):
        return {**fields, "sliding_window": None, "layer_types": None}
    first = d.get("max_window_layers", 28)  # HF's default
    if slides is None and not d.get("layer_types"):
        return {**fields, "layer_types": None}
    return {**fields, "layer_types": _layer_types(d, lambda i: slides(i, first))}


# HF's per-family rules for which layers slide, when layer_types is not saved.
_QWEN2_SLIDES = lambda i, first: i >= first  # noqa: E731
_QWEN2_MOE_SLIDES = lambda i, first: bool((i + 1) % 2) and i < first  # noqa: E731


def _mistral(d):
    return _llama(d)  # the window (if any) applies to every layer


def _qwen2(d):
    fields = _llama(d)
    return _qwen_window(d, {**fields, "qkv_bias": True, "o_bias": False}, _QWEN2_SLIDES)


def _qwen3(d):
    return _qwen_window(d, {**_llama(d), "qk_norm": True}, _QWEN2_SLIDES)


def _gemma(d, sliding_every: int) -> dict[str, Any]:
    fields = _llama(d)
    return {
        **fields,
        "hidden_act": d.get("hidden_activation") or d.get("hidden_act", "gelu_pytorch_tanh"),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": True,
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or fields["head_dim"]),
        "attn_soft_cap": d.get("attn_logit_softcapping"),
        "final_soft_cap": d.get("final_logit_softcapping"),
        "layer_types": _layer_types(d, lambda i: bool((i + 1) % sliding_every)),
    }


def _gemma2(d):
    return _gemma(d, sliding_every=2)


def _gemma3(d):
    fields = _gemma(d, sliding_every=d.get("sliding_window_pattern", 6))
    params = d.get("rope_parameters") or {}
    if FULL in params:  # transformers 5: rope parameters per layer type
        theta, rope = _rope(d, params[FULL])
        local_theta, local = _rope(d, params.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling {local} on Gemma 3's sliding layers")
    else:  # 4.x: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        theta, rope = _rope({"rope_theta": d.get("rope_theta", 1_000_000.0)}, d.get("rope_scaling"))
        local_theta = d.get("rope_local_base_freq", 10_000.0)
    return {
        **fields,
        "qk_norm": True,
        "attn_soft_cap": None,  # Gemma 3 keeps the field but does not cap attention logits
        "rope_theta": theta,
        "rope_scaling": hashable_rope(rope),
        "rope_local_theta": float(local_theta),
    }


def _moe_layers(d: dict[str, Any], num_experts: int) -> tuple[bool, ...] | None:
    """Qwen-MoE's decoder_sparse_step and mlp_only_layers; None when every layer is MoE."""
    step = d.get("decoder_sparse_step", 1) or 1
    dense = set(d.get("mlp_only_layers") or ())
    flags = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0
        for i in range(d["num_hidden_layers"])
    )
    return None if all(flags) else flags


def _mixtral(d):
    return {
        **_llama(d),
        "num_experts": d["num_local_experts"],
        "num_experts_per_tok": d["num_experts_per_tok"],
        "moe_intermediate_size": d["intermediate_size"],
        "norm_topk_prob": True,  # Mixtral always renormalises its top-k weights
    }


def _qwen_moe(d, qk_norm: bool, shared: bool, slides) -> dict[str, Any]:
    fields = _llama(d)
    experts = d.get("num_experts") or d.get("num_local_experts") or 0
    if not qk_norm:  # Qwen2-MoE: biased q/k/v, no o bias
        fields.update(qkv_bias=bool(d.get("qkv_bias", True)), o_bias=False)
    return _qwen_window(
        d,
        {
            **fields,
            "qk_norm": qk_norm,
            "num_experts": experts,
            "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size", 0)
            if shared
            else 0,
            "moe_layer_flags": _moe_layers(d, experts),
        },
        slides,
    )


def _qwen2_moe(d):
    return _qwen_moe(d, qk_norm=False, shared=True, slides=_QWEN2_MOE_SLIDES)


def _qwen3_moe(d):
    return _qwen_moe(d, qk_norm=True, shared=False, slides=None)  # every layer slides


def _phi3(d):
    fields = _llama(d)
    rope = dict(fields["rope_scaling"] or ())
    if rope.get("rope_type") in ("su", "yarn"):  # Phi-3's old names for LongRoPE
        rope["rope_type"] = "longrope"
    if rope.get("rope_type") == "longrope":
        rope.setdefault(
            "original_max_position_embeddings",
            d.get("original_max_position_embeddings") or fields["max_position_embeddings"],
        )
    params = d.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0
    rotary = int(fields["head_dim"] * partial)
    return {
        **fields,
        "rope_scaling": hashable_rope(rope),
        "rotary_dim": None if rotary == fields["head_dim"] else rotary,
    }


def _opt(d):
    hidden = d["hidden_size"]
    if not d.get("layer_norm_elementwise_affine", True):
        raise ValueError("OPT without elementwise-affine layer norms is not supported")
    proj = d.get("word_embed_proj_dim") or hidden
    before = bool(d.get("do_layer_norm_before", True))
    bias = bool(d.get("enable_bias", True))
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["ffn_dim"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        num_kv_heads=d["num_attention_heads"],
        head_dim=hidden // d["num_attention_heads"],
        rms_norm_eps=1e-5,  # torch.nn.LayerNorm's default, which OPT uses
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        hidden_act=d.get("activation_function", "relu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos(d),
        learned_positions=True,
        layer_norm=True,
        gated_mlp=False,
        norm_before=before,
        final_norm=before and not d.get("_remove_final_layer_norm", False),
        word_embed_proj_dim=None if proj == hidden else proj,
    )


FAMILIES = (
    Family("llama", "LlamaForCausalLM", ("llama",), _llama),
    Family("mistral", "MistralForCausalLM", ("mistral",), _mistral),
    Family("qwen2", "Qwen2ForCausalLM", ("qwen2",), _qwen2),
    Family("qwen3", "Qwen3ForCausalLM", ("qwen3",), _qwen3),
    Family("gemma2", "Gemma2ForCausalLM", ("gemma2",), _gemma2),
    Family("gemma3", "Gemma3ForCausalLM", ("gemma3_text",), _gemma3),
    Family("mixtral", "MixtralForCausalLM", ("mixtral",), _mixtral),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", ("qwen2_moe",), _qwen2_moe),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",), _qwen3_moe),
    Family("phi3", "Phi3ForCausalLM", ("phi3",), _phi3),
    Family("opt", "OPTForCausalLM", ("opt",), _opt),
)
_BY_ARCH = {f.architecture: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED_ARCHITECTURES = {f.architecture: f.name for f in FAMILIES}


def family_of(architecture: str) -> Family:
    if architecture not in _BY_ARCH:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return _BY_ARCH[architecture]


def family_for_hf(d: dict[str, Any]) -> Family:
    """The family of a Hugging Face ``config.json`` dict, found by its ``architectures`` (then
    its ``model_type``); an unsupported one raises a ValueError listing the supported ones."""
    archs = d.get("architectures") or []
    family = next((_BY_ARCH[a] for a in archs if a in _BY_ARCH), None)
    family = family or _BY_MODEL_TYPE.get(d.get("model_type", ""))
    if family is None:
        found = archs or d.get("model_type")
        raise ValueError(
            f"unsupported architecture {found!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return family
