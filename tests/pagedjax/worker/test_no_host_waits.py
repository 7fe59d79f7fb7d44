"""Nothing in a step waits on the host: the step, sampler and verify programs hold no conditional
or loop (on a GPU a ``lax.cond`` makes dispatch wait until the device is done), whichever static
variant a batch picks; what a batch needs is decided on the host (``SamplingInput``'s static
fields).

The programs are lowered for CUDA, where the wait matters (lowering needs no GPU): on a CPU JAX
lowers the random bits' threefry rounds as a loop of fixed length, unrolled everywhere else."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from pagedjax.models.config import ModelConfig
from pagedjax.models.linear import process_weights_after_loading
from pagedjax.models.llama import param_shapes

from pagedjax.worker import programs, sampler, step_program
from pagedjax.worker.input_batch import InputBatcher, StepShape
from pagedjax.worker.rejection import verify_step
from pagedjax.worker.sampler import Filters, SamplingInput, SamplingRow

V = 300  # wider than the candidates (256): the full-sort path exists
ROWS = 8
_BRANCHES = re.compile(r"stablehlo\.(case|if|while)\b|\b(conditional|while)\(")


def branches(text: str) -> list[str]:
    return [m.group(0) for m in _BRANCHES.finditer(text)]


def cuda_text(fn, *args) -> str:
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _args(variant: sampler.Variant):
    s = SamplingInput.build([variant.row()], ROWS, V, history_width=16)
    assert s.variant == variant
    logits = np.zeros((ROWS, V), np.float32)
    return logits, np.arange(ROWS, dtype=np.int32), s


def _sampler_args(variant: sampler.Variant):
    logits, _, s = _args(variant)
    return (logits, *step_program.pack_sampling(s), ROWS)


@pytest.mark.parametrize("variant", sampler.variants(), ids=str)
def test_sampler_programs_hold_no_branch(variant):
    text = cuda_text(programs.sample, *_sampler_args(variant))
    assert not branches(text), f"{variant}: {branches(text)}"


def _step_program_args(variant: sampler.Variant | None):
    config = ModelConfig("LlamaForCausalLM", V, 32, 64, 1, 2, 1, 16)
    batcher = InputBatcher(4, 32)
    step = batcher.empty(StepShape(ROWS, ROWS, 8, 1))  # a decode step
    logit_rows = np.arange(ROWS, dtype=np.int32)
    sampling = None
    if variant is not None:
        sampling = SamplingInput.build([variant.row()], ROWS, V)
    packed, layout = step_program.pack_inputs(step, logit_rows, sampling)
    pool = jax.ShapeDtypeStruct((1, 16, 4, 16), np.float32)  # (kv heads, blocks, block, dim)
    prev = np.zeros(ROWS, np.int32)
    # One array per layer, as on a GPU (the scan over stacked layers is a loop of fixed length).
    stacked = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), param_shapes(config))
    params, weights = process_weights_after_loading(stacked, config, layer_loop="unrolled")
    model = programs.ModelStatics(config, "reference", None, weights)
    args = (params, (pool, pool), packed, prev, model)
    return (*args, layout)


@pytest.mark.parametrize("variant", [None, *step_program.step_variants()], ids=str)
def test_decode_step_programs_hold_no_branch(variant):
    # The step program of a decode step samples its batch itself: greedily, or by each sampler
    # variant it can hold.
    text = cuda_text(programs.step, *_step_program_args(variant))
    assert not branches(text), f"{variant}: {branches(text)}"


def test_verify_and_compiled_programs_hold_no_branch():
    general = sampler.Variant(True, True, True, Filters.SORT)
    logits, rows, s = _args(general)
    drafts = np.full(ROWS, -1, np.int32)
    assert not branches(cuda_text(verify_step, logits, rows, s, drafts))
    assert not branches(cuda_text(verify_step, logits, rows, s, drafts, logits))
    compiled = programs.sample.lower(*_sampler_args(general)).compile().as_text()  # CPU
    assert "conditional(" not in compiled


def test_the_check_sees_a_conditional():
    def with_cond(x):
        return jax.lax.cond(x.sum() > 0, lambda: x + 1, lambda: x)

    assert branches(cuda_text(jax.jit(with_cond), np.zeros(4, np.float32)))


def test_the_variant_follows_the_rows():
    build = lambda rows: SamplingInput.build(rows, ROWS, V).variant  # noqa: E731
    assert str(build([SamplingRow()])) == "greedy"
    # Greedy rows are never filtered, whatever they set.
    assert build([SamplingRow(top_p=0.5, top_k=3)]).filters == Filters.MIN_P
    # A sampling batch takes the candidates; the sort only for top-p or a top-k past them.
    assert build([SamplingRow(1.0, min_p=0.1)]).filters == Filters.CANDIDATES
    assert build([SamplingRow(1.0, top_k=256)]).filters == Filters.CANDIDATES
    assert build([SamplingRow(1.0, top_k=257)]).filters == Filters.SORT
    assert build([SamplingRow(1.0, top_k=V + 5)]).filters == Filters.CANDIDATES  # k >= vocab: off
    assert build([SamplingRow(1.0, top_k=5), SamplingRow(top_p=0.9)]).filters == Filters.SORT
    # Six sampler programs per row count, three sampling in a decode step: no more.
    assert len(set(sampler.variants())) == len(sampler.variants()) == 6
    assert all(v.constrained for v in sampler.variants())
    assert len(set(step_program.step_variants())) == 3
    # A variant no sampler program runs is refused; a sampling one takes the candidates at least.
    assert sampler.Variant(random=True).filters == Filters.CANDIDATES
    with pytest.raises(ValueError, match="no sampler program"):
        sampler.Variant(random=True, filters=Filters.MIN_P)
    assert SamplingInput.build([SamplingRow()], ROWS, V, constrained=True).variant.constrained


def test_plain_greedy_agrees_with_the_built_variant():
    rng = np.random.default_rng(5)
    pick = lambda *xs: xs[rng.integers(len(xs))]  # noqa: E731
    for _ in range(200):
        rows = [
            SamplingRow(
                temperature=pick(0.0, 0.0, 0.0, 0.7),
                top_p=pick(1.0, 0.9),
                repetition_penalty=pick(1.0, 1.0, 1.0, 1.2),
                presence_penalty=pick(0.0, 0.0, 0.0, 0.5),
                frequency_penalty=pick(0.0, 0.0, 0.0, -0.3),
                logit_bias=pick((), (), (), ((3, 1.0),)),
                token_bitmask=pick(None, None, None, np.full(10, -1, np.int32)),
            )
            for _ in range(int(rng.integers(1, 4)))
        ]
        k = int(pick(0, 0, 2))
        built = SamplingInput.build(rows, ROWS, V).variant
        assert sampler.plain_greedy(rows, k) == (k == 0 and built == sampler.Variant()), rows
