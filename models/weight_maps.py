"""Hugging Face safetensors names -> our parameter names, one explicit map per family.

A map is ``regex -> [(our name template, transform), ...]``: the template is filled with the
regex's groups, and the transform turns the checkpoint array (HF orientation, ``[out, in]``) into
ours. One checkpoint tensor may give several of ours (Phi-3's fused qkv_proj and gate_up_proj are
split at load, so that tensor parallelism splits q, k and v each by heads).

Our names: ``layers_{i}/...`` is layer ``i``'s slice of the stacked ``layers/...`` (a MoE family's
``layers_{i}/mlp/...`` is its row of ``moe/...`` or ``dense_mlp/...``); a trailing ``[e]`` is
index ``e`` of the next axis (an expert of a stacked expert array).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .config import ModelConfig

# A transform turns the checkpoint array into ours.
Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]
WeightMap = dict[str, list[tuple[str, Transform]]]
T: Transform = lambda w, c: w.T  # noqa: E731 (Dense kernels are [in, out])
KEEP: Transform = lambda w, c: w  # noqa: E731

_L = r"model\.layers\.(\d+)\."

_LLAMA: WeightMap = {
    r"model\.embed_tokens\.weight": [("embed_tokens/embedding", KEEP)],
    r"model\.norm\.weight": [("norm/weight", KEEP)],
    r"lm_head\.weight": [("lm_head/kernel", T)],
    _L + r"self_attn\.([qkvo])_proj\.weight": [("layers_{0}/self_attn/{1}_proj/kernel", T)],
    _L + r"self_attn\.([qkvo])_proj\.bias": [("layers_{0}/self_attn/{1}_proj/bias", KEEP)],
    _L + r"mlp\.(gate|up|down)_proj\.weight": [("layers_{0}/mlp/{1}_proj/kernel", T)],
    _L + r"mlp\.(gate|up|down)_proj\.bias": [("layers_{0}/mlp/{1}_proj/bias", KEEP)],
    _L + r"(input_layernorm|post_attention_layernorm)\.weight": [("layers_{0}/{1}/weight", KEEP)],
}
_QK_NORM: WeightMap = {
    _L + r"self_attn\.([qk])_norm\.weight": [("layers_{0}/self_attn/{1}_norm/weight", KEEP)],
}
_GEMMA: WeightMap = {
    **_LLAMA,
    _L + r"(pre_feedforward_layernorm|post_feedforward_layernorm)\.weight": [
        ("layers_{0}/{1}/weight", KEEP)
    ],
}
_QWEN_MOE: WeightMap = {
    **_LLAMA,  # attention, norms, and the dense MLP of mlp_only layers
    _L + r"mlp\.gate\.weight": [("layers_{0}/mlp/router/kernel", T)],
    _L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight": [
        ("layers_{0}/mlp/experts/{2}_proj[{1}]", T)
    ],
    _L + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight": [
        ("layers_{0}/mlp/shared_expert/{1}_proj/kernel", T)
    ],
    _L + r"mlp\.shared_expert_gate\.weight": [("layers_{0}/mlp/shared_expert_gate/kernel", T)],
}
_MIXTRAL: WeightMap = {
    **_LLAMA,
    _L + r"block_sparse_moe\.gate\.weight": [("layers_{0}/mlp/router/kernel", T)],
    _L + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight": [
        ("layers_{0}/mlp/experts/gate_proj[{1}]", T)
    ],
    _L + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight": [
        ("layers_{0}/mlp/experts/up_proj[{1}]", T)
    ],
    _L + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight": [
        ("layers_{0}/mlp/experts/down_proj[{1}]", T)
    ],
}


def _rows(start: Callable[[ModelConfig], int], stop: Callable[[ModelConfig], int]) -> Transform:
    """Rows ``start(c):stop(c)`` of a fused [out, in] weight, as a [in, out] kernel."""
    return lambda w, c: w[start(c) : stop(c)].T


_Q = lambda c: c.num_heads * c.head_dim  # noqa: E731
_QK = lambda c: (c.num_heads + c.num_kv_heads) * c.head_dim  # noqa: E731
_QKV = lambda c: (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # noqa: E731
_I = lambda c: c.intermediate_size  # noqa: E731
_PHI3: WeightMap = {
    **_LLAMA,
    _L + r"self_attn\.qkv_proj\.weight": [
        ("layers_{0}/self_attn/q_proj/kernel", _rows(lambda c: 0, _Q)),
        ("layers_{0}/self_attn/k_proj/kernel", _rows(_Q, _QK)),
        ("layers_{0}/self_attn/v_proj/kernel", _rows(_QK, _QKV)),
    ],
    _L + r"mlp\.gate_up_proj\.weight": [
        ("layers_{0}/mlp/gate_proj/kernel", _rows(lambda c: 0, _I)),
        ("layers_{0}/mlp/up_proj/kernel", _rows(_I, lambda c: 2 * c.intermediate_size)),
    ],
}

_D = r"(?:model\.)?decoder\."  # OPT (older checkpoints lack the "model." prefix)
_OPT: WeightMap = {
    _D + r"embed_tokens\.weight": [("embed_tokens/embedding", KEEP)],
    _D + r"embed_positions\.weight": [("embed_positions/embedding", KEEP)],
    _D + r"project_(in|out)\.weight": [("project_{0}/kernel", T)],
    _D + r"final_layer_norm\.weight": [("norm/scale", KEEP)],
    _D + r"final_layer_norm\.bias": [("norm/bias", KEEP)],
    r"lm_head\.weight": [("lm_head/kernel", T)],
    _D + r"layers\.(\d+)\.self_attn\.([qkv])_proj\.weight": [
        ("layers_{0}/self_attn/{1}_proj/kernel", T)
    ],
    _D + r"layers\.(\d+)\.self_attn\.([qkv])_proj\.bias": [
        ("layers_{0}/self_attn/{1}_proj/bias", KEEP)
    ],
    _D + r"layers\.(\d+)\.self_attn\.out_proj\.weight": [("layers_{0}/self_attn/o_proj/kernel", T)],
    _D + r"layers\.(\d+)\.self_attn\.out_proj\.bias": [("layers_{0}/self_attn/o_proj/bias", KEEP)],
    _D + r"layers\.(\d+)\.self_attn_layer_norm\.weight": [
        ("layers_{0}/input_layernorm/scale", KEEP)
    ],
    _D + r"layers\.(\d+)\.self_attn_layer_norm\.bias": [("layers_{0}/input_layernorm/bias", KEEP)],
    _D + r"layers\.(\d+)\.final_layer_norm\.weight": [
        ("layers_{0}/post_attention_layernorm/scale", KEEP)
    ],
    _D + r"layers\.(\d+)\.final_layer_norm\.bias": [
        ("layers_{0}/post_attention_layernorm/bias", KEEP)
    ],
    _D + r"layers\.(\d+)\.fc1\.weight": [("layers_{0}/mlp/up_proj/kernel", T)],
    _D + r"layers\.(\d+)\.fc1\.bias": [("layers_{0}/mlp/up_proj/bias", KEEP)],
    _D + r"layers\.(\d+)\.fc2\.weight": [("layers_{0}/mlp/down_proj/kernel", T)],
    _D + r"layers\.(\d+)\.fc2\.bias": [("layers_{0}/mlp/down_proj/bias", KEEP)],
}

HF_WEIGHT_MAPS: dict[str, WeightMap] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORM},
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, **_QK_NORM},
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": {**_QWEN_MOE, **_QK_NORM},
    "phi3": _PHI3,
    "opt": _OPT,
}
