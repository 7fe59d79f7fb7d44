"""engine.inspect(), the step record, snapshot / replay and diff, on a tiny random model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hf_models import random_prompts, tiny_llama_dir

from pagedjax import LLM, SamplingParams
from pagedjax.inspection.state import Snapshot, diff

BLOCK = 8
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "inspection_tiny", tokenizer=True)


def _check_pool(view) -> None:
    pool = view.pool
    assert pool.num_used + pool.num_cached + pool.num_free == pool.num_blocks - 1
    assert pool.state.count("used") == pool.num_used
    for r in view.requests.values():
        for s in r.sequences:
            if s.location == "device":
                assert sum(s.tokens_per_block) >= s.num_computed_tokens
                for b, refs in zip(s.block_table, s.ref_counts, strict=True):
                    assert pool.state[b] == "used" and pool.ref_counts[b] == refs >= 1


def test_views_of_running_and_finished_requests(tiny):
    llm = LLM(tiny, block_size=BLOCK, num_blocks=64, max_model_len=128)
    engine = llm.engine
    prompt = random_prompts(1, seed=1, lo=20, hi=21)[0]
    engine.add_request("solo", prompt, GREEDY)
    assert engine.inspect()["solo"].status == "waiting"
    engine.step()
    view = engine.inspect()
    _check_pool(view)
    solo = view["solo"]
    (seq,) = solo.sequences
    assert (solo.status, seq.location, seq.num_computed_tokens) == ("running", "device", 20)
    assert seq.block_table and seq.tokens_per_block == (8, 8, 4)
    assert seq.ref_counts == (1, 1, 1) and view.running == ("solo",)
    assert view.last_step.scheduled == (("solo", seq.seq_id, 0, 20),)
    while engine.has_unfinished_requests():
        engine.step()
    # Finished and dropped from engine.requests: its last state is kept.
    assert "solo" not in engine.requests
    done = engine.inspect()["solo"]
    (last,) = done.sequences
    assert done.finished and last.finish_reason == "length" and last.location == "released"
    assert len(last.output_token_ids) == 12 and last.num_computed_tokens == 31
    assert last.tokens_per_block == (8, 8, 8, 7) and len(last.block_table) == 4
    assert view["solo"].sequences[0].num_tokens == 21  # the earlier view did not change
    assert "solo" in done._repr_html_() and "<table>" in engine.inspect()._repr_html_()
    engine.add_request("text", "one two three", SamplingParams(max_tokens=1))
    engine.step()
    assert engine.inspect()["text"].prompt == "one two three"  # finished, prompt kept

    # Parallel samples share the prompt's blocks; the next request hits the prefix cache.
    engine.add_request("pair", prompt, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3))
    engine.step()
    pair = engine.inspect()["pair"]
    a, b = pair.sequences
    assert a.block_table == b.block_table and pair.shared_blocks == a.block_table
    assert set(a.ref_counts) == {2}
    assert pair.num_cached_tokens == 16  # two full blocks of the same prompt, computed by solo
    engine.step()
    a, b = engine.inspect()["pair"].sequences
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert engine.inspect().last_step.blocks_copied  # copy-on-write of the shared last block


def _run(engine, late_at: int, until: int | None = None) -> dict[str, list[list[int]]]:
    """Step to the end (or to step ``until``), adding an unseeded request at step ``late_at``;
    returns every finished request's tokens, and checks each step's view."""
    tokens = {}
    while engine.has_unfinished_requests() and engine.inspect().step != until:
        if engine.inspect().step == late_at:
            engine.add_request(
                "late", random_prompts(1, seed=9, lo=5)[0], SamplingParams(max_tokens=10)
            )
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
        _check_pool(engine.inspect())
    return tokens


def _submit(engine) -> None:
    seeded = SamplingParams(max_tokens=14, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=14, temperature=0.8, ignore_eos=True)
    for i, p in enumerate(random_prompts(8, seed=4, lo=5)):
        engine.add_request(f"r{i}", p, [GREEDY, seeded, unseeded][i % 3])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_snapshot_under_preemption_replays_the_same_tokens(tiny, mode, tmp_path):
    kwargs = dict(block_size=BLOCK, num_blocks=20, max_model_len=128, preemption_mode=mode)
    engine = LLM(tiny, **kwargs).engine
    _submit(engine)
    while not any(r.preempted for r in engine.history.steps):
        engine.step()
    engine.step()
    assert engine.has_unfinished_requests()
    if mode == "swap":
        assert engine.inspect().swapped or engine.inspect().pool.num_host_used
    snap = engine.snapshot()
    snap.save(tmp_path / "snap.pkl")
    late_at = snap.step + 2
    first = _run(engine, late_at)
    assert set(first) == {f"r{i}" for i in range(8)} | {"late"}

    # Replay on the same engine, then on a fresh one loaded from the file: same tokens.
    engine.restore(snap)
    assert diff(snap, engine.snapshot()) == []
    assert _run(engine, late_at) == first
    fresh = LLM(tiny, **kwargs).engine
    fresh.restore(Snapshot.load(tmp_path / "snap.pkl"))
    mid = _run(fresh, late_at, until=snap.step + 4)
    later = fresh.snapshot()
    replayed = {**mid, **_run(fresh, late_at)}
    assert replayed == first
    assert fresh.get_stats().num_blocks_used == 0

    # Two snapshots of one run differ in readable lines, KV contents included.
    lines = diff(snap, later)
    assert lines[0] == f"step: {snap.step} -> {snap.step + 4}"
    assert any(line.startswith("kv: blocks with other contents") for line in lines)
    assert any("seq" in line and "tokens" in line for line in lines)
    assert any(line.startswith("+ request 'late'") for line in lines)


def test_restore_refuses_another_configuration(tiny):
    engine = LLM(tiny, block_size=BLOCK, num_blocks=32, max_model_len=128).engine
    snap = engine.snapshot()
    other = LLM(tiny, block_size=BLOCK, num_blocks=40, max_model_len=128).engine
    with pytest.raises(ValueError, match="configured"):
        other.restore(snap)


def test_a_refused_restore_changes_nothing_with_a_step_in_flight(tiny):
    """The configuration is checked before anything is touched: with async scheduling (the
    default) the step in flight survives a refused restore and every request ends as it would."""
    engine = LLM(tiny, block_size=BLOCK, num_blocks=32, max_model_len=128).engine
    snap = engine.snapshot()
    other = dataclasses.replace(snap, config=dataclasses.replace(snap.config, seed=1))
    prompts = random_prompts(3, seed=5, lo=5)

    def run(name: str, refuse_at: int | None) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(f"{name}{i}", p, GREEDY)
        tokens, step = {}, 0
        while engine.has_unfinished_requests():
            if step == refuse_at:
                with pytest.raises(ValueError, match="configured"):
                    engine.restore(other)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            step += 1
        return [tokens[f"{name}{i}"] for i in range(len(prompts))]

    want = run("a", None)
    assert [len(t) for t in want] == [12] * 3
    assert run("b", 2) == want  # decoding, a step in flight
    assert run("c", 6) == want


def test_drawings(tiny):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from pagedjax.inspection.plotting import draw_block_tables, draw_pool, plot_history

    engine = LLM(tiny, block_size=BLOCK, num_blocks=32, max_model_len=128).engine
    for i, p in enumerate(random_prompts(3, seed=2, lo=5)):
        engine.add_request(f"r{i}", p, SamplingParams(n=2, max_tokens=4, seed=i))
    for _ in range(2):
        engine.step()
    view = engine.inspect()
    ax = draw_block_tables(view, title="tables")
    cells = sum(len(s.block_table) for r in view.requests.values() for s in r.sequences)
    assert cells and len(ax.patches) == cells
    ax = draw_pool(view)
    assert len(ax.patches) == view.pool.num_blocks + view.pool.num_used + view.pool.num_cached
    mem, queues = plot_history(engine.history.steps)
    assert mem.collections and queues.lines


def test_importing_pagedjax_imports_no_matplotlib_or_torch():
    code = (
        "import sys, pagedjax, pagedjax.inspection.state, pagedjax.inspection.plotting; "
        "print(sorted({'matplotlib', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
