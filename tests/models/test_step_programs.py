"""The compiled model step: one copy of the layer whatever the model's depth (layers under scan),
and the KV pool updated in place: donated, never copied (whole or one layer's share), and read
only inside attention (by its gathers, or in place by the native CPU kernel)."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest
from pagedjax.models.config import ModelConfig
from pagedjax.models.layer_loop import split_layers
from pagedjax.models.llama import param_shapes
from pagedjax.models.step_input import StepInput

from pagedjax.worker import programs

NUM_BLOCKS, BLOCK = 256, 8  # a layer's pool is larger than any weight, so sizes tell it apart
_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_OP = re.compile(r"= \w+\[[\d,]*\]\S* ([\w-]+)\(%([^,)\s]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def config(layers: int) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 256, 64, 128, layers, 4, 2, 16)


def step_hlo(layers: int, max_query_len: int, unroll: bool = False) -> str:
    c = config(layers)
    pool = jax.ShapeDtypeStruct((2, layers * NUM_BLOCKS, BLOCK, 16), jnp.float32)
    t, s, b = (8, 8, 4) if max_query_len == 1 else (32, 8, 4)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    step = StepInput(
        i32((t,)), i32((t,)), i32((t,)), i32((s, b)), i32((s,)), i32((s + 1,)), i32((s,)),
        max_query_len=max_query_len,
    )  # fmt: skip
    params = param_shapes(c)
    if unroll:  # one tree per layer (models/layer_loop.py): the layers unrolled
        params = split_layers(params, c)
    args = (params, (pool, pool), step, programs.ModelStatics(c, "reference"))
    return programs.forward.lower(*args).compile().as_text()


def aliased_params(hlo: str) -> set[int]:
    header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
    return {int(p) for p in re.findall(r"\{[\d, ]*\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}


def pool_reads(hlo: str, layer_elements: int) -> list[tuple[str, str]]:
    """(opcode, op_name) of every copy, slice, dynamic-slice or gather whose operand holds at
    least one layer's share of the pool (in whatever shape: bitcasts reshape it)."""
    sizes = {}
    for line in hlo.splitlines():
        m = _DEF.match(line)
        if m:
            sizes[m[1]] = math.prod(int(d) for d in m[3].split(",") if d)
    found = []
    for line in hlo.splitlines():
        m = _OP.search(line)
        pool_sized = m and sizes.get(m[2], 0) >= layer_elements
        if pool_sized and m[1] in ("copy", "slice", "dynamic-slice", "gather"):
            name = _OP_NAME.search(line)
            found.append((m[1], name[1] if name else ""))
    return found


@pytest.mark.parametrize("unroll", [False, True], ids=["scan", "unrolled"])
@pytest.mark.parametrize("max_query_len", [1, 16], ids=["decode", "prefill"])
def test_step_updates_the_pool_in_place(max_query_len, unroll):
    layers = 4
    hlo = step_hlo(layers, max_query_len, unroll)
    params = param_shapes(config(layers))
    num_params = len(jax.tree.leaves(split_layers(params, config(layers)) if unroll else params))
    assert {num_params, num_params + 1} <= aliased_params(hlo), "pool not donated to the output"
    reads = pool_reads(hlo, layer_elements=2 * NUM_BLOCKS * BLOCK * 16)
    copies = [r for r in reads if r[0] != "gather"]
    assert not copies, f"the step copies or slices the pool: {copies}"
    gathers = [name for op, name in reads if op == "gather"]
    # On a CPU the native kernel reads the pool in place (a custom call); XLA's path gathers.
    native = re.search(r'custom_call_target="pagedjax_PagedAttention(Decode|Ragged)_', hlo)
    assert gathers or native, "attention should read its context from the pool"
    # Inside the attention module (its backend's kernels; the projections never read the pool)
    outside = [name for name in gathers if "/self_attn/" not in name]
    assert not outside, f"the pool is gathered outside attention: {outside}"


def test_pool_checks_catch_a_copy_of_a_layer():
    """The checks above would see a step that slices one layer's pages out of the pool."""

    def sliced(pool, layer):
        return jax.lax.dynamic_slice_in_dim(pool, layer * NUM_BLOCKS, NUM_BLOCKS, axis=1) * 2

    pool = jax.ShapeDtypeStruct((2, 4 * NUM_BLOCKS, BLOCK, 16), jnp.float32)
    hlo = jax.jit(sliced).lower(pool, 1).compile().as_text()
    reads = pool_reads(hlo, layer_elements=2 * NUM_BLOCKS * BLOCK * 16)
    assert reads and all(op != "gather" for op, _ in reads)


def _num_dots(hlo: str) -> int:
    # XLA's dots, and the native CPU matmuls (custom calls named after their handler)
    return len(re.findall(r" dot\(|custom-call\(.*matmul", hlo, flags=re.IGNORECASE))


def test_program_size_does_not_grow_with_depth():
    shallow, deep = step_hlo(2, 16), step_hlo(8, 16)
    assert _num_dots(deep) == _num_dots(shallow)
    assert len(deep.splitlines()) < 1.1 * len(shallow.splitlines())
    unrolled = step_hlo(8, 16, unroll=True)  # what the size would be without the scan
    assert _num_dots(unrolled) > 2 * _num_dots(deep)
