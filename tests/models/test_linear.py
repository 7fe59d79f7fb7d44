"""Linear methods chosen at load (models/linear.py): one per Dense from its weights as loaded, a
platform's own only where it offers them (never on a mesh), and models/ free of any platform's
weight layout."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pagedjax.models import quant
from pagedjax.models.config import ModelConfig
from pagedjax.models.linear import (
    ColumnQuantLinear,
    GroupedQuantLinear,
    WeightLayout,
    XlaLinear,
    XlaTable,
    choose_layout,
    process_weights_after_loading,
)
from pagedjax.models.llama import param_shapes

MODELS = Path(__file__).resolve().parents[2] / "models"
# hidden 64 (q/k/v/gate/up inputs: groups of 64), intermediate 96 (down's inputs: per channel)
CONFIG = ModelConfig("LlamaForCausalLM", 256, 64, 96, 2, 4, 2, 16)


def zeros(config: ModelConfig) -> dict:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), param_shapes(config))


def test_models_know_no_platform_layout():
    """No ``packed`` flag in models/, and no import of the native kernels or layer_matmul: a
    platform's methods are passed in (models/linear.py)."""
    for path in MODELS.glob("**/*.py"):
        text = path.read_text()
        assert "packed" not in text, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not {"native", "layer_matmul"} & {n.split(".")[-1] for n in names}, path


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int8-g64"])
def test_each_dense_gets_the_method_of_its_weights(quantization):
    params = quant.quantize_params(zeros(CONFIG), quantization)
    methods = dict(choose_layout(params, CONFIG).methods)
    grouped = quantization.endswith("g64")
    assert methods["self_attn/q_proj"] == (GroupedQuantLinear() if grouped else ColumnQuantLinear())
    assert methods["mlp/down_proj"] == ColumnQuantLinear()  # 96 inputs: one scale per column
    assert methods["lm_head"] == (GroupedQuantLinear() if grouped else ColumnQuantLinear())
    assert dict(choose_layout(zeros(CONFIG), CONFIG).methods)["mlp/up_proj"] == XlaLinear()


class _Offers:
    """A platform that offers a method for every layer projection and the table."""

    def choose(self, projections, table):
        self.seen = len(projections)
        return "layers", "table"


def test_a_platforms_methods_apply_to_the_stacked_layers_only():
    platform = _Offers()
    layout = choose_layout(zeros(CONFIG), CONFIG, platform)
    assert platform.seen == 7 and layout.table == "table"
    methods = dict(layout.methods)
    assert methods["self_attn/o_proj"] == "layers" and methods["lm_head"] == XlaLinear()
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("tp",))
    _, on_mesh = process_weights_after_loading(zeros(CONFIG), CONFIG, mesh, "scan", platform)
    assert on_mesh == choose_layout(zeros(CONFIG), CONFIG)  # XLA's: sharded kernels
    assert on_mesh.table == XlaTable() and WeightLayout().linear("lm_head") == XlaLinear()


def test_grouped_experts_scale_each_row_by_its_expert():
    """The experts' method: rows sorted by expert, one ragged matmul, each row's output times
    its expert's column scales."""
    rows = jax.random.normal(jax.random.key(0), (5, 8))
    kernels = jax.random.normal(jax.random.key(1), (3, 8, 4))
    sizes, row_expert = jnp.asarray([2, 0, 3]), jnp.asarray([0, 0, 2, 2, 2])
    scale = jnp.asarray([[1.0, 2, 3, 4], [9, 9, 9, 9], [0.5, 0.5, 1, 1]])
    experts = WeightLayout().experts
    plain = experts.apply(rows, kernels, sizes)
    want = jnp.concatenate([rows[:2] @ kernels[0], rows[2:] @ kernels[2]])
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5)
    scaled = experts.apply(rows, kernels, sizes, scale, row_expert)
    np.testing.assert_allclose(scaled, want * scale[row_expert], rtol=1e-5, atol=1e-5)
