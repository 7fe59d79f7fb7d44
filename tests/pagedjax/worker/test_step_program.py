"""One program per step (worker/step_program.py): a greedy decode step dispatches one program and
sends one host array, the sampled tokens come back as one array, and the step program still
updates the KV pool in place (donated, never copied)."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import tiny_llama_dir
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import param_shapes

from pagedjax import LLM, SamplingParams
from pagedjax.worker import programs, sampler, step_program
from pagedjax.worker.input_batch import InputBatcher, ScheduledSeq
from pagedjax.worker.sampler import SamplerOutput, SamplingInput, SamplingRow

NUM_BLOCKS, BLOCK = 256, 8
_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_OP = re.compile(r"= \w+\[[\d,]*\]\S* ([\w-]+)\(%([^,)\s]+)")


def _step_program_hlo(max_query_len: int) -> tuple[str, int]:
    c = ModelConfig("LlamaForCausalLM", 256, 64, 128, 4, 4, 2, 16)
    pool = jax.ShapeDtypeStruct((2, 4 * NUM_BLOCKS, BLOCK, 16), jnp.float32)
    batcher = InputBatcher(BLOCK, 64)
    q = 1 if max_query_len == 1 else 5
    seqs = [ScheduledSeq([1] * q, 3, [1], [SamplingRow()]) for _ in range(3)]
    step = batcher.build(seqs)
    packed, layout = step_program.pack_inputs(step, np.zeros(len(step.logits_indices), np.int32))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    params = param_shapes(c)
    model = programs.ModelStatics(c, "reference")
    args = (params, (pool, pool), i32(packed.shape), i32((16,)), model)
    hlo = programs.step.lower(*args, layout).compile().as_text()
    return hlo, len(jax.tree.leaves(params))


@pytest.mark.parametrize("max_query_len", [1, 16], ids=["decode", "prefill"])
def test_the_step_program_updates_the_pool_in_place(max_query_len):
    hlo, num_params = _step_program_hlo(max_query_len)
    header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
    alias = r"\{[\d, ]*\}: \((\d+), \{\}, (?:may|must)-alias"
    aliased = {int(p) for p in re.findall(alias, header)}
    assert {num_params, num_params + 1} <= aliased, "pool not donated to the output"
    sizes = {}
    for line in hlo.splitlines():
        if m := _DEF.match(line):
            sizes[m[1]] = math.prod(int(d) for d in m[3].split(",") if d)
    layer = 2 * NUM_BLOCKS * BLOCK * 16
    copies = [
        line.strip()[:120]
        for line in hlo.splitlines()
        if (m := _OP.search(line))
        and m[1] in ("copy", "slice", "dynamic-slice")
        and sizes.get(m[2], 0) >= layer
    ]
    assert not copies, f"the step program copies or slices the pool: {copies}"


def test_inputs_and_outputs_pack_and_unpack():
    batcher = InputBatcher(BLOCK, 64)
    seqs = [ScheduledSeq([5, 6, 7], 2, [1, 2], [SamplingRow()]), ScheduledSeq([9], 4, [3], [])]
    step = batcher.build(seqs)
    rows = np.arange(len(step.logits_indices), dtype=np.int32)[::-1].copy()
    packed, layout = step_program.pack_inputs(step, rows)
    assert packed.dtype == np.int32 and packed.ndim == 1
    back, back_rows, no_sampling = jax.jit(step_program.unpack_inputs, static_argnums=1)(
        packed, layout
    )
    assert no_sampling is None and layout.sampling is None
    for name in ("token_ids", "positions", "slot_mapping", "block_tables", "context_lens"):
        np.testing.assert_array_equal(getattr(back, name), getattr(step, name), err_msg=name)
    np.testing.assert_array_equal(back.query_start_loc, step.query_start_loc)
    np.testing.assert_array_equal(back.logits_indices, step.logits_indices)
    np.testing.assert_array_equal(back_rows, rows)
    assert back.max_query_len == step.max_query_len
    # A sampled decode step's sampling input travels in the same buffer.
    sampling = SamplingInput.build([SamplingRow(0.7, top_k=3, seed=9)] * 2, len(rows), 300)
    packed, layout = step_program.pack_inputs(step, rows, sampling)
    assert packed.ndim == 1 and layout.sampling is not None
    back, back_rows, back_sampling = jax.jit(step_program.unpack_inputs, static_argnums=1)(
        packed, layout
    )
    np.testing.assert_array_equal(back.block_tables, step.block_tables)
    np.testing.assert_array_equal(back_rows, rows)
    assert back_sampling.variant == sampling.variant
    for a, b in zip(jax.tree.leaves(back_sampling), jax.tree.leaves(sampling), strict=True):
        np.testing.assert_array_equal(a, b)
    out = SamplerOutput(
        tokens=np.array([3, 1], np.int32),
        logprobs=np.array([-0.5, -np.inf], np.float32),
        top_token_ids=np.array([[3, 4], [1, 0]], np.int32),
        top_logprobs=np.array([[-0.5, -1.25], [-2.0, np.nan]], np.float32),
    )
    host = step_program.unpack_output(np.asarray(step_program.pack_output(out)))
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_step_program")


class _CountTransfers:
    """Host arrays sent to the device: by ``jax.device_put``, or handed to a program (jit
    transfers them), whatever the runner counts."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real_put, real_step, real_sample = jax.device_put, programs.step, programs.sample

        def put(*args, **kwargs):
            self.calls += len(jax.tree.leaves(args[0]))
            return real_put(*args, **kwargs)

        def counting(program):
            def run(*args):
                self.calls += sum(isinstance(x, np.ndarray) for x in jax.tree.leaves(args))
                return program(*args)

            return run

        monkeypatch.setattr(jax, "device_put", put)
        monkeypatch.setattr(programs, "step", counting(real_step))
        monkeypatch.setattr(programs, "sample", counting(real_sample))


def test_a_greedy_decode_step_is_one_program_and_one_transfer(tiny, monkeypatch):
    # With async scheduling: the fill from the step before's device tokens is in the program.
    llm = LLM(tiny, block_size=8, max_model_len=64, num_blocks=32, max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], greedy)
    for _ in range(3):  # the prompts, then decode steps
        engine.step()
    puts = _CountTransfers(monkeypatch)
    programs, transfers, steps = runner.step_ops.num_programs, runner.step_ops.num_transfers, 6
    for _ in range(steps):
        engine.step()
    assert runner.step_ops.num_programs - programs == steps, "a greedy decode step is one program"
    assert runner.step_ops.num_transfers - transfers == steps, "its inputs are one transfer"
    assert puts.calls == steps, "a transfer outside the runner's count"
    assert engine.steps.num_overlapped >= steps  # each filled from the step before's tokens
    # A sampled decode step (with top logprobs) is one program and one transfer too: its
    # sampling input travels in the step's buffer and the step program samples it.
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, logprobs=2)
    engine.add_request("s", [9, 10, 11], sampled)
    for _ in range(2):  # its prompt (a mixed step), then decode steps
        engine.step()
    puts = _CountTransfers(monkeypatch)
    programs, transfers = runner.step_ops.num_programs, runner.step_ops.num_transfers
    for _ in range(3):
        engine.step()
    ops = runner.step_ops
    assert (ops.num_programs - programs, ops.num_transfers - transfers) == (3, 3)
    assert puts.calls == 3, "a transfer outside the runner's count"
    while engine.has_unfinished_requests():
        engine.step()
    # Penalties keep their own sampler program (a token history per row): two of each.
    engine.add_request("p", [9, 10, 11], SamplingParams(max_tokens=6, frequency_penalty=0.5))
    for _ in range(2):
        engine.step()
    programs, transfers = runner.step_ops.num_programs, runner.step_ops.num_transfers
    for _ in range(3):
        engine.step()
    ops = runner.step_ops
    assert (ops.num_programs - programs, ops.num_transfers - transfers) == (6, 6)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_sampling_input_packs_into_one_buffer():
    rows = [
        SamplingRow(0.7, top_k=5, top_p=0.9, seed=3, position=11, repetition_penalty=1.2,
                    prompt_token_ids=[4, 5], output_token_ids=[6], logit_bias=((7, -1.5),)),
        SamplingRow(),
    ]  # fmt: skip
    s = SamplingInput.build(rows, 4, 300, history_width=8)
    packed, layout = step_program.pack_sampling(s)
    assert packed.dtype == np.int32 and packed.ndim == 1
    back = jax.jit(step_program.unpack_sampling, static_argnums=1)(packed, layout)
    assert back.variant == s.variant
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(s), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)


def test_a_sampled_decode_step_samples_as_the_sampler_program_does(tiny, monkeypatch):
    # One decode step, sampled inside the step program, then the same step again through the
    # step program and the sampler program: the same tokens and logprobs, bit for bit.
    llm = LLM(tiny, block_size=8, max_model_len=64, num_blocks=32, max_num_seqs=4)
    runner = llm.engine.runner
    rows = [
        SamplingRow(0.8, top_p=0.9, seed=1, position=6),
        SamplingRow(1.0, top_k=5, seed=2, position=6),
        SamplingRow(0.7, min_p=0.2, seed=3, position=6),
        SamplingRow(position=6),
    ]
    tables = [[1 + i] for i in range(4)]
    prompts = [ScheduledSeq([3 + i, 4, 5, 6, 7], 0, tables[i], []) for i in range(4)]
    runner.execute(prompts)
    decode = [ScheduledSeq([8 + i], 5, tables[i], [rows[i]], seq_id=i) for i in range(4)]
    programs = runner.step_ops.num_programs
    one = runner.execute(decode, num_top_logprobs=3).sampled
    assert runner.step_ops.num_programs - programs == 1
    monkeypatch.setattr(sampler, "needs_own_program", lambda row: True)  # the sampler program
    two = runner.execute(decode, num_top_logprobs=3).sampled
    assert runner.step_ops.num_programs - programs == 3
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True):
        np.testing.assert_array_equal(a, b)
    assert one.top_token_ids.shape == (4, 3)
    llm.close()
