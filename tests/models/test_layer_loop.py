"""The layer loop chosen at load (models/layer_loop.py): the layers unrolled over one parameter
tree per layer compute the scan's logits (float32, tight tolerance), for families whose layers
differ (Gemma 2's alternating windows, a MoE with a dense layer, Phi-3's LongRoPE), and the
unrolled program reads every weight where it lies."""

from __future__ import annotations

import collections
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import save_tiny_config
from pagedjax.models import layer_loop
from pagedjax.models.config import ModelConfig
from pagedjax.models.linear import process_weights_after_loading
from pagedjax.models.llama import forward, param_shapes
from pagedjax.models.sharding import param_shardings
from pagedjax.models.step_input import StepInput

from pagedjax.worker.runner import Runner, RunnerConfig, ScheduledSeq

BLOCK = 8
PROMPT_LENS = [3, 13, 23]  # past Gemma 2's window of 8


def tiny_config(name: str, tmp_path, **overrides) -> ModelConfig:
    save_tiny_config(name, tmp_path, **overrides)
    return ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, 0.2, s.shape), s.dtype), param_shapes(config)
    )


def run_logits(config, params, loop: str, monkeypatch) -> np.ndarray:
    """Prefill logits at every position of three packed prompts, then two decode steps."""
    monkeypatch.setenv(layer_loop.ENV_LAYER_LOOP, loop)
    runner = Runner(config, params, RunnerConfig(num_blocks=32, block_size=BLOCK, max_model_len=64))
    assert layer_loop.is_per_layer(runner.params) == (loop == "unrolled")
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, config.vocab_size, n).tolist() for n in PROMPT_LENS]
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(seqs))]
    out = [
        runner.forward_logits(
            [ScheduledSeq(s, 0, t) for s, t in zip(seqs, tables, strict=True)], True
        )
    ]
    for _ in range(2):
        for s in seqs:
            s.append(int(rng.integers(3, config.vocab_size)))
        step = [ScheduledSeq([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
        out.append(runner.forward_logits(step))
    return np.concatenate(out)


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("llama_gqa", {}),
        ("gemma2", {}),
        ("qwen2_moe", {}),  # layer 1 dense (mlp_only_layers), a shared expert
        pytest.param("phi3", {}, marks=pytest.mark.slow),
    ],
)
def test_unrolled_layers_give_the_scans_logits(name, overrides, tmp_path, monkeypatch):
    c = tiny_config(name, tmp_path, **overrides)
    params = random_params(c)
    scan = run_logits(c, params, "scan", monkeypatch)
    unrolled = run_logits(c, params, "unrolled", monkeypatch)
    np.testing.assert_allclose(unrolled, scan, rtol=1e-5, atol=1e-5 * np.abs(scan).max())


def test_split_layers_takes_each_layers_rows(tmp_path):
    """Layer i's tree holds row i of every stack, and a MoE layer its row of its kind's stack."""
    c = tiny_config("qwen2_moe", tmp_path)
    params = random_params(c)
    split = layer_loop.split_layers(params, c)
    assert "moe" not in split and "dense_mlp" not in split and len(split["layers"]) == 3
    for i, tree in enumerate(split["layers"]):
        kind, row = c.mlp_stack_row(i)
        stacked = params["layers"]["self_attn"]["q_proj"]["kernel"]
        np.testing.assert_array_equal(tree["self_attn"]["q_proj"]["kernel"], stacked[i])
        want = jax.tree.map(lambda a, r=row: a[r], params[kind])
        jax.tree.map(np.testing.assert_array_equal, tree[kind], want)
    assert layer_loop.split_layers(split, c) is split


def test_layer_loop_is_checked(monkeypatch):
    monkeypatch.setenv(layer_loop.ENV_LAYER_LOOP, "sideways")
    with pytest.raises(ValueError, match="sideways"):
        layer_loop.default_layer_loop()
    monkeypatch.delenv(layer_loop.ENV_LAYER_LOOP)
    assert layer_loop.default_layer_loop() == "scan"  # this CPU


def test_per_layer_shardings_follow_one_layers_rules(tmp_path):
    """Split per layer, each layer's arrays take one layer's specs (no stacked axis)."""
    c = tiny_config("qwen2_moe", tmp_path)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    split = layer_loop.split_layers(param_shapes(c), c)
    specs = param_shardings(split, mesh)
    P = jax.sharding.PartitionSpec
    assert specs["layers"][0]["self_attn"]["q_proj"]["kernel"].spec == P(None, "tp")
    assert specs["layers"][0]["self_attn"]["o_proj"]["kernel"].spec == P("tp", None)
    assert specs["layers"][0]["moe"]["experts"]["down_proj"].spec == P(None, "tp", None)
    stacked = param_shardings(param_shapes(c), mesh)
    assert stacked["layers"]["self_attn"]["q_proj"]["kernel"].spec == P(None, None, "tp")


# An operand of a copy, slice or dynamic-slice, and its shape, in optimized HLO.
_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]")
_SLICE = re.compile(r"= \w+\[([\d,]*)\]\S* (copy|slice|dynamic-slice)\(")


def weight_copies(hlo: str, weight_shapes: set[tuple[int, ...]]) -> list[str]:
    """Lines of the HLO that produce a copy or slice shaped like a layer's weight."""
    found = []
    for line in hlo.splitlines():
        m = _SLICE.search(line)
        if m and tuple(int(d) for d in m[1].split(",") if d) in weight_shapes:
            found.append(line.strip()[:160])
    return found


def _decode_hlo(params, c: ModelConfig) -> str:
    pool = jax.ShapeDtypeStruct((2, c.num_layers * 32, BLOCK, c.head_dim), jnp.float32)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    step = StepInput(
        i32((8,)), i32((8,)), i32((8,)), i32((8, 4)), i32((8,)), i32((9,)), i32((8,)),
        max_query_len=1,
    )  # fmt: skip
    # A fresh function: programs traced with native kernels on are not reused (nor these later)
    fn = jax.jit(lambda *args: forward(*args), static_argnums=(3, 4, 5))
    return fn.lower(params, (pool, pool), step, c, "reference", None).compile().as_text()


def test_unrolled_step_reads_weights_in_place(monkeypatch):
    """With native kernels off (XLA's dots only, as on a GPU), the unrolled decode step neither
    copies nor slices a weight; the scan over the same weights does (the check can fail). On an
    H200, XLA:GPU's scan held a dynamic-slice fusion producing each layer's whole
    bf16[1,14336,4096] before its GEMM (0.39-0.40 of the memory floor; unrolled over per-layer
    arrays, 0.99-1.15)."""
    monkeypatch.setenv("PAGEDJAX_NATIVE", "0")
    c = ModelConfig("LlamaForCausalLM", 256, 64, 128, 4, 4, 2, 16)
    stacked = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), param_shapes(c))
    kernels = jax.tree.leaves(stacked["layers"], is_leaf=lambda x: hasattr(x, "ndim"))
    shapes = {a.shape[1:] for a in kernels if a.ndim == 3}
    shapes |= {(1, *s) for s in shapes}  # a slice keeping the layer axis
    split, _ = process_weights_after_loading(stacked, c, layer_loop="unrolled")
    assert layer_loop.is_per_layer(split)
    assert weight_copies(_decode_hlo(split, c), shapes) == []
    assert weight_copies(_decode_hlo(stacked, c), shapes)


@pytest.mark.parametrize(
    "name,kinds",
    [("llama_gqa", 1), ("gemma2", 2), ("qwen2_moe", 2)],  # windows alternate; a dense MoE layer
)
def test_unrolled_layers_are_traced_once_per_kind(name, kinds, tmp_path, monkeypatch):
    """A step over unrolled layers traces each kind of layer once (its index is traced), not
    each layer: the tracing of a deep model's step stays that of a few layers."""
    from pagedjax.models import decoder

    c = tiny_config(name, tmp_path, num_hidden_layers=6)
    traced, per_step = [], []
    layer_call = decoder.DecoderLayer.__call__
    unrolled = decoder._unrolled_layers

    def counting_call(self, *args, **kwargs):
        traced.append(1)
        return layer_call(self, *args, **kwargs)

    def counting_loop(*args, **kwargs):
        start = len(traced)
        out = unrolled(*args, **kwargs)
        per_step.append(len(traced) - start)
        return out

    monkeypatch.setattr(decoder.DecoderLayer, "__call__", counting_call)
    monkeypatch.setattr(decoder, "_unrolled_layers", counting_loop)
    run_logits(c, random_params(c), "unrolled", monkeypatch)
    assert per_step and set(per_step) == {kinds}, per_step  # one per kind in every program


def _instructions(hlo: str) -> collections.Counter:
    """A compiled program's instructions, without names, metadata or the source-frame tables."""
    lines = []
    for line in hlo.splitlines():
        if " = " not in line or re.match(r"^\s*\d+ ", line):
            continue
        line = re.sub(r",?\s*(stack_frame_id=\d+|metadata=\{[^}]*\})", "", line)
        lines.append(re.sub(r"%[\w.\-]+", "%x", line).strip().rstrip(","))
    return collections.Counter(lines)


def test_layers_traced_once_compile_to_the_program_traced_layer_by_layer(tmp_path, monkeypatch):
    """XLA inlines the layer calls and folds each layer's index: the compiled decode and prefill
    steps are instruction for instruction those of the layers traced one by one."""
    from pagedjax.models import decoder

    from pagedjax.worker.warmup_jobs import lower_step

    c = tiny_config("gemma2", tmp_path, num_hidden_layers=4)
    monkeypatch.setenv(layer_loop.ENV_LAYER_LOOP, "unrolled")
    sizes = RunnerConfig(num_blocks=32, block_size=BLOCK, max_model_len=64)
    runner = Runner(c, random_params(c), sizes)
    shapes = runner.step_shapes(4, 64)
    shapes = [next(s for s in shapes if s.max_query_len == 1), shapes[-1]]  # decode, prefill
    once = [_instructions(lower_step(runner, s).compile().as_text()) for s in shapes]
    traced = []
    by_layer = decoder._layers_one_by_one
    monkeypatch.setattr(
        decoder, "_unrolled_layers", lambda *a, **k: traced.append(1) or by_layer(*a, **k)
    )
    jax.clear_caches()
    one_by_one = [_instructions(lower_step(runner, s).compile().as_text()) for s in shapes]
    assert len(traced) == len(shapes) and all(sum(o.values()) > 100 for o in once)
    assert once == one_by_one
