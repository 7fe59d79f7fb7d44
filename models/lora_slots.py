"""LoRA adapters on the device: the slots every step reads, and the batched LoRA matmul.

``LoRASlots`` holds, per target module, ``a`` [num_layers, num_slots, in, max_rank] and ``b``
[num_layers, num_slots, max_rank, out] (``num_slots = max_loras + 1``): slot 0 is "no adapter"
and stays zero; a lower rank is padded with zeros; an adapter's scaling is folded into its
``b``. ``set_slot`` writes one slot (the slot index traced, the shapes fixed by the slots: a new
adapter never compiles a new program). Under tensor parallelism a module's slots are split as
its base projection is (models/sharding.py): a column-parallel projection's ``a`` replicated and
``b`` split on out; a row-parallel one's (o_proj, down_proj) ``a`` split on in, ``b``
replicated.

``LoRABatch(slots, token_slot)`` is the model's ``lora`` argument: each token row's slot (0: the
base model). Every targeted projection adds ``(x @ a[slot]) @ b[slot]`` to each row
(``lora_delta``): the products of every slot are computed in one batched matmul per stage, and
each row selects its own with ``jnp.where``, never by multiplying the others by a zero mask,
since 0 x NaN is NaN: a slot holding a NaN or an inf reaches no row but its own (not the base
model's, not padding). Measured on a CPU against a gather of each row's ``a``/``b`` (which
copies every row's weights) and against rows grouped by slot (``jax.lax.ragged_dot``, which
XLA:CPU computes group by group over all rows), at 64 and 512 rows of a 2048 -> 2048 projection
with rank 16: computing every slot's product was the fastest with 4 adapters (several times at
64 rows, tens of times at 512) and with 16; only with 32 did the gather overtake it, at 64 rows.
Its cost grows with the slots: keep ``max_loras`` to what the batches use.

Slots hold finite values only: ``check_adapter_fits`` refuses an adapter whose weights, scaled
and cast to the slots' dtype, are not finite (models/lora.py refuses non-finite weights at load
already; this catches an overflow of the cast, e.g. to float16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .sharding import AXIS

# Our projection names, by where they sit in a layer (models/decoder.py).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # split on their input under TP


@struct.dataclass
class LoRASlots:
    a: dict[str, jax.Array]  # module -> [num_layers, num_slots, in, max_rank]
    b: dict[str, jax.Array]  # module -> [num_layers, num_slots, max_rank, out], scaling folded

    @property
    def num_slots(self) -> int:
        return next(iter(self.a.values())).shape[1]

    @property
    def max_rank(self) -> int:
        return next(iter(self.a.values())).shape[3]


@struct.dataclass
class LoRABatch:
    slots: LoRASlots
    token_slot: jax.Array  # i32[num_tokens], 0 = base model (padding rows: 0)

    def module(self, name: str) -> ModuleLoRA | None:
        """This module's stacks and the rows' slots, or None where no slot targets it."""
        if name not in self.slots.a:
            return None
        return ModuleLoRA(self.slots.a[name], self.slots.b[name], self.token_slot)


@struct.dataclass
class ModuleLoRA:
    """One projection's slots over every layer, and each token row's slot."""

    a: jax.Array  # [num_layers, num_slots, in, max_rank]
    b: jax.Array  # [num_layers, num_slots, max_rank, out]
    token_slot: jax.Array  # i32[num_tokens]

    def delta(self, x: jax.Array, layer) -> jax.Array:  # [num_tokens, out], x's dtype
        return lora_delta(x, self.a[layer], self.b[layer], self.token_slot)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, token_slot: jax.Array) -> jax.Array:
    """``(x[t] @ a[s]) @ b[s]`` for each row t and its slot s = token_slot[t] (slot 0, the base
    model, and padding rows: zero). Each stage computes every adapter slot (1..S-1) for every
    row and keeps the row's own by selection, so another slot's NaN or inf never reaches it.
    x: [T, in]; a: [S, in, r]; b: [S, r, out] -> [T, out]."""
    adapters = jnp.arange(1, a.shape[0], dtype=token_slot.dtype)
    own = token_slot[:, None] == adapters[None, :]  # bool[T, S - 1]: at most one True per row
    xa = jnp.einsum("ti,sir->tsr", x, a[1:].astype(x.dtype), preferred_element_type=jnp.float32)
    xa = jnp.where(own[:, :, None], xa, 0.0).sum(axis=1).astype(x.dtype)  # [T, r]: own slot's
    y = jnp.zeros((x.shape[0], b.shape[2]), jnp.float32)  # [T, out]
    for s in range(1, a.shape[0]):  # S - 1 matmuls [T, r] x [r, out]: the FLOPs of one einsum
        ys = jnp.dot(xa, b[s].astype(x.dtype), preferred_element_type=jnp.float32)
        y = jnp.where(own[:, s - 1 : s], ys, y)
    return y.astype(x.dtype)


def module_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of its base projection."""
    c = config
    q, kv, h, i = (
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.hidden_size,
        c.intermediate_size,
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def lora_modules(config: ModelConfig) -> tuple[str, ...]:
    """The projections an adapter may target in this model: attention everywhere; the MLP's
    where it is one dense MLP per layer (not a MoE family's experts), gated or not."""
    if config.num_experts:
        return ATTENTION_MODULES
    mlp = MLP_MODULES if config.gated_mlp else ("up_proj", "down_proj")
    return ATTENTION_MODULES + mlp


def slot_specs(name: str) -> tuple[P, P]:
    """(a's spec, b's spec) of module ``name``'s slots, as its base projection is split."""
    if name in ROW_PARALLEL:
        return P(None, None, AXIS, None), P()
    return P(), P(None, None, None, AXIS)


def init_slots(
    model_config: ModelConfig, max_loras: int, max_rank: int, dtype, mesh: Mesh | None = None
) -> LoRASlots:
    """Zeroed slots for every module an adapter may target (``max_loras`` slots plus slot 0,
    rank ``max_rank``), in ``dtype``; on a ``mesh`` each device holds its slice (a dimension
    the degree does not divide stays whole)."""
    num_slots, rank = max_loras + 1, max_rank
    lead = (model_config.num_layers, num_slots)
    a, b = {}, {}
    for name in lora_modules(model_config):
        n_in, n_out = module_dims(model_config)[name]
        a_spec, b_spec = slot_specs(name) if mesh is not None else (None, None)
        a[name] = _zeros((*lead, n_in, rank), dtype, mesh, a_spec)
        b[name] = _zeros((*lead, rank, n_out), dtype, mesh, b_spec)
    return LoRASlots(a, b)


def _zeros(shape, dtype, mesh: Mesh | None, spec: P | None) -> jax.Array:
    if mesh is None:
        return jnp.zeros(shape, dtype)
    tp = mesh.shape[AXIS]
    if any(axis and dim % tp for axis, dim in zip(spec, shape, strict=False)):
        spec = P()
    return jnp.zeros(shape, dtype, device=NamedSharding(mesh, spec))


def set_slot(slots: LoRASlots, slot: int, adapter) -> LoRASlots:
    """``slots`` with slot ``slot`` holding ``adapter`` (a models/lora.py LoRAAdapter), or zeroed
    for None. Functional: ``slots`` is donated (do not use it after). The adapter is padded to
    the slots' rank and scaled on the host, so every call runs the same compiled program."""
    if not 1 <= slot < slots.num_slots:
        raise ValueError(f"slot must be in [1, {slots.num_slots - 1}], got {slot}")
    check_adapter_fits(slots, adapter)
    return _writer_of(slots)(slots, jnp.int32(slot), _one_slot(slots, adapter))


def check_adapter_fits(slots: LoRASlots, adapter) -> None:
    """Refuse, with a ValueError naming the adapter and the module, an adapter these slots
    cannot hold: a rank above theirs, or weights that are not finite once scaled and cast to
    the slots' dtype (a NaN or inf in a slot would make its rows' outputs NaN)."""
    if adapter is None:
        return
    if adapter.rank > slots.max_rank:
        raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {slots.max_rank}")
    for name, (wa, wb) in sorted(adapter.weights.items()):
        if name not in slots.a:
            continue
        dtype = slots.a[name].dtype
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = np.asarray(wb, np.float32) * np.float32(adapter.scaling)
        for which, w in (("lora_A", wa), (f"lora_B x scaling {adapter.scaling:g}", scaled)):
            with np.errstate(over="ignore", invalid="ignore"):  # what the check is for
                cast = np.asarray(w, np.float32).astype(dtype).astype(np.float32)
            if not np.isfinite(cast).all():
                raise ValueError(
                    f"LoRA adapter {adapter.path!r}: {name} {which} is not finite in the slots' "
                    f"dtype {np.dtype(dtype).name}"
                )


def lower_set_slot(slots: LoRASlots):
    """``set_slot``'s program for these slots, lowered (compiled at warm-up)."""
    return _writer_of(slots).lower(slots, jnp.int32(1), _one_slot(slots, None))


def _one_slot(slots: LoRASlots, adapter) -> LoRASlots:
    a, b = {}, {}
    for name in slots.a:
        a[name], b[name] = _slot_arrays(slots, name, adapter)
    return LoRASlots(a, b)


def _writer_of(slots: LoRASlots):
    leaves, treedef = jax.tree.flatten(slots)
    return _slot_writer(treedef, tuple(x.sharding for x in leaves))


def _slot_arrays(slots: LoRASlots, name: str, adapter) -> tuple[np.ndarray, np.ndarray]:
    """Module ``name``'s (a [L, in, max_rank], b [L, max_rank, out]) for one slot, on the host:
    the adapter's weights zero-padded to the rank, b scaled; zeros where it has none."""
    layers, _, n_in, rank = slots.a[name].shape
    n_out = slots.b[name].shape[3]
    dtype = slots.a[name].dtype
    a = np.zeros((layers, n_in, rank), np.float32)
    b = np.zeros((layers, rank, n_out), np.float32)
    if adapter is not None and name in adapter.weights:
        wa, wb = adapter.weights[name]  # [L, in, r], [L, r, out'] (unscaled)
        wb = _widen_kv_heads(wb, n_out, adapter.head_dim) if wb.shape[2] != n_out else wb
        a[:, :, : adapter.rank] = wa
        b[:, : adapter.rank, :] = wb * np.float32(adapter.scaling)
    return a.astype(dtype), b.astype(dtype)


def _widen_kv_heads(b: np.ndarray, n_out: int, head_dim: int) -> np.ndarray:
    """A k/v projection's ``b`` [L, r, kv_heads * head_dim] with each head repeated, for slots
    whose model replicates KV heads up to the tensor-parallel degree
    (models/sharding.py ``replicate_kv_heads``)."""
    heads = b.shape[2] // head_dim
    if n_out % b.shape[2] or n_out // head_dim % heads:
        raise ValueError(f"adapter output width {b.shape[2]} does not fit the slots' {n_out}")
    per_head = b.reshape(*b.shape[:2], heads, head_dim)
    return np.repeat(per_head, n_out // b.shape[2], axis=2).reshape(*b.shape[:2], n_out)


@functools.lru_cache(maxsize=32)
def _slot_writer(treedef, shardings: tuple):
    """The jitted write of one slot, its outputs placed as the slots were (donated in)."""

    def write(slots: LoRASlots, slot, new: LoRASlots) -> LoRASlots:
        put = lambda whole, one: jax.lax.dynamic_update_index_in_dim(whole, one, slot, 1)  # noqa: E731
        return jax.tree.map(put, slots, new)

    out = jax.tree.unflatten(treedef, shardings)
    return jax.jit(write, donate_argnums=(0,), out_shardings=out)


def slots_nbytes(slots: LoRASlots) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(slots))


__all__ = [
    "LoRABatch",
    "LoRASlots",
    "ModuleLoRA",
    "TARGET_MODULES",
    "check_adapter_fits",
    "init_slots",
    "lora_delta",
    "lora_modules",
    "lower_set_slot",
    "module_dims",
    "set_slot",
]
