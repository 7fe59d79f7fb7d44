"""The scheduler as plain Python: FCFS, token budget, chunked prefill, preemption, swap order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from import_checks import assert_imports_no_jax

from pagedjax.config import SchedulerConfig
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4
_ids = iter(range(10**6))


def group(name: str, prompt_len: int, arrival: float, width: int = 1) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(3, 3 + prompt_len)), BS)
    return SequenceGroup(name, [seq], arrival, SimpleNamespace(max_num_seqs=width))


def make(num_blocks=64, budget=64, max_seqs=8, mode="recompute", host=64, chunked=True):
    bm = BlockManager(num_blocks, BS, num_host_blocks=host, watermark=0.0)
    return bm, Scheduler(
        bm,
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            preemption_mode=mode,
        ),
    )


def run_step(sched: Scheduler, out, token: int = 7) -> None:
    """What the engine does after a step: advance computed tokens, sample when up to date."""
    for c in out.chunks:
        c.seq.num_computed_tokens += c.num_tokens
        if c.seq.num_computed_tokens == c.seq.get_len():
            c.seq.append_token_id(token)


def names(out) -> list[str]:
    return [c.group.request_id for c in out.chunks]


def test_fcfs_admission_under_the_token_budget():
    bm, sched = make(budget=20)
    for i, n in enumerate([8, 8, 8]):
        sched.add(group(f"r{i}", n, i))
    out = sched.schedule()
    # r2's whole prompt does not fit after r0 and r1: it gets the 4 tokens left (chunked).
    assert [(c.group.request_id, c.num_tokens) for c in out.chunks] == [
        ("r0", 8),
        ("r1", 8),
        ("r2", 4),
    ]
    assert out.num_batched_tokens == 20
    assert not out.chunks[2].completes and out.chunks[0].completes


def test_decodes_come_before_prompt_chunks():
    bm, sched = make(budget=6)
    sched.add(group("old", 3, 0))
    run_step(sched, sched.schedule())  # old's prompt, then it decodes
    sched.add(group("long", 20, 1))
    out = sched.schedule()
    assert [(c.group.request_id, c.num_tokens) for c in out.chunks] == [("old", 1), ("long", 5)]
    run_step(sched, out)
    out = sched.schedule()
    assert [(c.group.request_id, c.num_tokens) for c in out.chunks] == [("old", 1), ("long", 5)]
    assert out.chunks[1].seq.num_computed_tokens == 5  # the chunk continues where it stopped


def test_without_chunking_a_prompt_waits_for_a_budget_that_fits():
    bm, sched = make(budget=10, chunked=False)
    sched.add(group("a", 8, 0))
    sched.add(group("b", 8, 1))
    assert names(sched.schedule()) == ["a"]


def test_max_num_seqs_counts_samples_and_beams():
    bm, sched = make(max_seqs=4)
    sched.add(group("n3", 4, 0, width=3))
    sched.add(group("n2", 4, 1, width=2))
    assert names(sched.schedule()) == ["n3"]


def _fill_until_preemption(sched, bm):
    for i in range(4):
        sched.add(group(f"r{i}", 7, i))  # 2 blocks each for the prompt
    out = sched.schedule()
    steps = 0
    while not out.preempted:
        run_step(sched, out)
        out = sched.schedule()
        steps += 1
        assert steps < 50
    return out


def test_recompute_preempts_the_latest_arrival_and_requeues_it_first():
    bm, sched = make(num_blocks=10, mode="recompute")
    out = _fill_until_preemption(sched, bm)
    victim = out.preempted[0]
    assert victim.request_id == "r3"
    assert sched.waiting[0] is victim
    seq = victim.get_seqs()[0]
    assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    assert not bm.has_blocks(seq)
    assert "r3" not in names(out)  # it does not run in the step that preempted it


def test_swap_preemption_and_resume_before_new_requests():
    bm, sched = make(num_blocks=10, mode="swap")
    out = _fill_until_preemption(sched, bm)
    victim = out.preempted[0]
    assert victim.request_id == "r3" and out.blocks_to_swap_out
    assert victim.get_seqs()[0].status is SequenceStatus.SWAPPED
    sched.add(group("late", 2, 99))
    # Free the running groups: the swapped group must come back before "late" is admitted.
    for g in list(sched.running):
        for s in g.get_seqs():
            sched.free_seq(s, SequenceStatus.FINISHED_STOPPED)
    sched.drop_finished()
    out = sched.schedule()
    assert out.blocks_to_swap_in and names(out)[0] == "r3"
    assert victim.get_seqs()[0].status is SequenceStatus.RUNNING


def test_a_group_of_several_sequences_is_swapped_even_in_recompute_mode():
    bm, sched = make(num_blocks=12, mode="recompute")
    g = group("pair", 5, 0, width=2)
    sched.add(g)
    run_step(sched, sched.schedule())
    parent = g.get_seqs()[0]
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    g.add(child)
    sched._preempt(g, out := sched.schedule())
    assert out.blocks_to_swap_out and all(
        s.status is SequenceStatus.SWAPPED for s in [parent, child]
    )


def test_abort_frees_blocks_wherever_the_request_is():
    bm, sched = make()
    sched.add(group("running", 5, 0))
    run_step(sched, sched.schedule())
    sched.add(group("waiting", 5, 1))
    free_before = bm.get_num_free_blocks()
    assert sched.abort("running").request_id == "running"
    assert bm.get_num_free_blocks() > free_before
    assert sched.abort("waiting") is not None and sched.abort("nope") is None
    assert not sched.has_unfinished()


def test_bad_preemption_mode_is_named():
    bm = BlockManager(8, BS)
    with pytest.raises(ValueError, match="'sometimes'"):
        Scheduler(
            bm,
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, preemption_mode="sometimes"),
        )


def test_scheduler_imports_no_jax():
    assert_imports_no_jax("pagedjax.core.scheduler", "pagedjax.config")


def test_abort_ends_unfinished_sequences_with_abort_and_keeps_finished_ones():
    bm, sched = make()
    g = group("r", 8, 0.0, width=2)
    sched.add(g)
    sched.schedule()
    (seq,) = g.get_seqs()
    other = seq.fork(next(_ids))
    bm.fork(seq, other)
    g.add(other)
    sched.finish_seq(other, "stop")
    sched.abort("r")
    assert (seq.finish_reason, seq.status) == ("abort", SequenceStatus.FINISHED_ABORTED)
    assert (other.finish_reason, other.status) == ("stop", SequenceStatus.FINISHED_STOPPED)
    assert bm.get_num_free_blocks() == bm.num_blocks - 1


def make_longrope(switch: int, budget: int = 64):
    bm = BlockManager(64, BS, watermark=0.0, enable_prefix_caching=True, rope_switch_len=switch)
    return bm, Scheduler(bm, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))


def test_longrope_sequence_is_re_prefilled_once_as_it_crosses_the_switch():
    """HF's Phi-3 generate re-runs the whole sequence (long factors) at the step whose input
    reaches switch + 1 tokens with at most switch cached; so does the scheduler, once, and the
    prefix cache does not hand it back its own short-factor blocks."""
    bm, sched = make_longrope(switch=12)
    g = group("r", 10, 0.0)
    seq = g.get_seqs()[0]
    sched.add(g)
    chunks = []
    for _ in range(6):
        out = sched.schedule()
        chunks.append([(c.seq.num_computed_tokens, c.num_tokens) for c in out.chunks])
        run_step(sched, out)
        for c in out.chunks:
            bm.mark_blocks_computed(c.seq)
    # prefill 10; decodes at 10, 11; at len 13 (12 computed): all 13 again; then decodes.
    assert chunks == [[(0, 10)], [(10, 1)], [(11, 1)], [(0, 13)], [(13, 1)], [(14, 1)]]
    assert sched.num_longrope_recomputes == 1 and seq.longrope_recomputed
    assert sched.num_preemptions == 0


def test_longrope_prompt_past_the_switch_waits_for_one_step_rather_than_chunks():
    bm, sched = make_longrope(switch=12, budget=20)
    sched.add(group("a", 8, 0.0))
    sched.add(group("b", 16, 1.0))  # past the switch: one step of 16, or nothing
    out = sched.schedule()
    assert [(c.group.request_id, c.num_tokens) for c in out.chunks] == [("a", 8)]
    run_step(sched, out)
    out = sched.schedule()  # a decodes (1), b's 16 fit the 19 left
    assert [(c.group.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 16)]


def test_longrope_prompt_longer_than_the_budget_is_chunked_past_the_switch():
    """Every chunk of a prompt past the switch runs with a context past it (the long factors):
    the first waits for a step with more room than the switch."""
    bm, sched = make_longrope(switch=12, budget=16)
    for i in range(4):
        sched.add(group(f"d{i}", 3, float(i)))
    sched.add(group("r", 40, 9.0))
    steps = []
    for i in range(5):
        out = sched.schedule()
        steps.append(
            [(c.group.request_id, c.seq.num_computed_tokens, c.num_tokens) for c in out.chunks]
        )
        run_step(sched, out)
        if i == 1:  # the short ones end: r has the budget to itself
            for j in range(4):
                sched.abort(f"d{j}")
    # The short prompts (12), then their decodes (4), leave r 4 and 12: it waits for 16.
    assert steps[0] == [(f"d{j}", 0, 3) for j in range(4)]
    assert steps[1] == [(f"d{j}", 3, 1) for j in range(4)]
    assert steps[2:] == [[("r", 0, 16)], [("r", 16, 16)], [("r", 32, 8)]]
    assert sched.num_longrope_recomputes == 0


def test_longrope_budget_within_the_switch_is_refused():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8 .* 12 tokens"):
        make_longrope(switch=12, budget=8)
    bm = BlockManager(64, BS, watermark=0.0, rope_switch_len=12)
    Scheduler(
        bm, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=12)
    )  # never crosses
