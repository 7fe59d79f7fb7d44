"""The device check's attention-backends stage (benchmarks/device_check/stages/backends.py) on
CPU: its float64 oracle agrees with the backends on poisoned pools, and it catches a wrong one."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from pagedjax.pallas_kernels import ReferenceBackend, select_backend

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SIZES = dict(seqs=4, max_context=40)


@pytest.fixture(scope="module")
def stage():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("device_check.stages.backends")


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize(
    "case",
    [
        dict(kind="decode", variant="window", gqa=8),
        dict(kind="ragged", variant="fp8", block_size=32),
        dict(kind="decode", variant="int8", dtype="float32", gqa=1),
    ],
    ids=lambda c: "-".join(str(v) for v in c.values()),
)
def test_backends_match_the_float64_oracle_on_poisoned_pools(stage, backend, case):
    row = stage.check_case(
        select_backend(backend), stage.Case(**case), SIZES, np.random.default_rng(0)
    )
    assert row["ok"], row
    assert row["rel_err"] <= row["tol"]


class _Shifted(ReferenceBackend):
    """A wrong backend: the reference's output, slightly off."""

    def decode(self, q, kv, md, opts):
        return super().decode(q, kv, md, opts) * jnp.asarray(1.01, q.dtype)


def test_a_wrong_backend_fails_its_case(stage):
    case = stage.Case(kind="decode", dtype="float32", head_dim=64)
    row = stage.check_case(_Shifted(), case, SIZES, np.random.default_rng(0))
    assert not row["ok"] and row["rel_err"] > row["tol"]


def test_the_case_list_covers_every_axis(stage):
    cases = stage.cases(short=False)
    assert {c.kind for c in cases} == {"decode", "ragged"}
    assert {c.gqa for c in cases} == {1, 4, 8}
    assert {c.block_size for c in cases} == {16, 32}
    assert {c.head_dim for c in cases} == {64, 128, 256}
    assert {c.dtype for c in cases} == {"float32", "bfloat16"}
    assert {c.variant for c in cases} == {"plain", "window", "soft_cap", "int8", "fp8"}
