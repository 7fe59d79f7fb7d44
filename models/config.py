"""ModelConfig: the hyperparameters of a decoder-only model, read from a Hugging Face config.

One frozen dataclass describes every supported family; the families are config-driven variants of
the shared decoder (models/decoder.py). ``models/registry.py`` turns a checkpoint's
``config.json`` fields into a ModelConfig's, family by family.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .registry import FULL, SLIDING, as_tuples, family_for_hf, family_of

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# HF activation name -> ours (models/layers.py).
SUPPORTED_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable (it is a static argument of the jitted step): sequences are tuples."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6  # the epsilon of every norm (RMSNorm, or LayerNorm for OPT)
    rope_theta: float = 10000.0
    # Sorted (key, value) pairs of the rope scaling parameters, or None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # the window of the sliding layers
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer SLIDING or FULL; None: every layer slides when sliding_window is set.
    layer_types: tuple[str, ...] | None = None
    rotary_dim: int | None = None  # partial rotary (Phi-3's partial_rotary_factor); None: head_dim
    qk_norm: bool = False  # RMSNorm of each q and k head before rope (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's 1 + weight
    sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs normed too (4 per layer)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the compute dtype
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_soft_cap: float | None = None  # attention logits -> cap * tanh(logits / cap) (Gemma 2)
    final_soft_cap: float | None = None  # the same on the output logits (Gemma 2)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own (plain) rope base
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    # Per layer whether its MLP is the MoE block; None: every layer (when num_experts > 0).
    moe_layer_flags: tuple[bool, ...] | None = None
    # OPT: learned positions, LayerNorm, plain (ungated) MLP, pre- or post-norm layers.
    learned_positions: bool = False  # position embeddings (offset 2) instead of rope
    layer_norm: bool = False  # LayerNorm with bias instead of RMSNorm
    gated_mlp: bool = True  # down(act(gate(x)) * up(x)); False: down(act(up(x)))
    norm_before: bool = True  # pre-norm layers; False: post-norm (OPT-350m)
    final_norm: bool = True  # a norm before the LM head
    word_embed_proj_dim: int | None = None  # OPT: embeddings narrower than hidden (project in/out)

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not self.learned_positions and self.rotary_dims % 2:
            raise ValueError(f"the rotary dimension must be even, got {self.rotary_dims}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; "
                f"supported: {sorted(SUPPORTED_ACTIVATIONS)}"
            )
        rope_type = self.rope_params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        for name, per_layer in (
            ("layer_types", self.layer_types),
            ("moe_layer_flags", self.moe_layer_flags),
        ):
            if per_layer is not None and len(per_layer) != self.num_layers:
                raise ValueError(
                    f"{name} has {len(per_layer)} entries for {self.num_layers} layers"
                )
        if self.layer_types is not None and set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"unsupported layer types {sorted(set(self.layer_types) - {SLIDING, FULL})}; "
                f"supported: {[SLIDING, FULL]}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}"
                )
        if not all(self.moe_layers) and self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive, got {self.intermediate_size}")

    @property
    def family(self) -> str:
        return family_of(self.architecture).name

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model supports (a sliding window does not cap it: the
        attention kernels attend within the window)."""
        return self.max_position_embeddings

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def longrope_switch_len(self) -> int | None:
        """LongRoPE (Phi-3): a sequence longer than this many tokens is rotated with the long
        factors, a shorter one with the short factors (models/layers.py ``rope_tables``). HF's
        generate re-runs a sequence that grows past it, so that its cached keys are rotated by
        the long factors too; an engine matching that recomputes such a sequence once. None: no
        switch."""
        if self.rope_params.get("rope_type") != "longrope":
            return None
        return int(self.rope_params["original_max_position_embeddings"])

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window (0: global)."""
        window = self.sliding_window or 0
        types = self.layer_types or (SLIDING,) * self.num_layers
        return tuple(window if t == SLIDING else 0 for t in types)

    @property
    def local_rope_layers(self) -> tuple[bool, ...]:
        """Layers that use the local rope base (Gemma 3's sliding layers)."""
        if self.rope_local_theta is None:
            return (False,) * self.num_layers
        return tuple(w > 0 for w in self.layer_windows)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        if not self.num_experts:
            return (False,) * self.num_layers
        return self.moe_layer_flags or (True,) * self.num_layers

    def mlp_stack_row(self, layer: int) -> tuple[str, int]:
        """Where a MoE family keeps ``layer``'s MLP: ("moe" | "dense_mlp", row in that stack).
        The two kinds of MLP differ in shape, so each is stacked over its own layers."""
        kind = self.moe_layers[layer]
        row = sum(1 for m in self.moe_layers[:layer] if m == kind)
        return ("moe" if kind else "dense_mlp"), row

    @property
    def embed_dim(self) -> int:
        return self.word_embed_proj_dim or self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of ``to_dict`` (after a JSON round trip, which turns tuples into lists)."""
        return cls(**{k: as_tuples(v) for k, v in d.items()})

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout);
        an unsupported architecture raises a ValueError listing the supported ones."""
        family = family_for_hf(d)
        return cls(architecture=family.architecture, **family.fields(d))


def longrope_attention_factor(config: ModelConfig) -> float:
    """LongRoPE's scale of cos and sin (HF's default when the config gives none)."""
    params = config.rope_params
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
