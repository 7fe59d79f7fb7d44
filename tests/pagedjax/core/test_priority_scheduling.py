"""vLLM's --scheduling-policy priority as plain Python: the queues' order (priority, then
arrival), admission, the running group preempted when blocks run out, the preemption of a
lower-priority running group for a waiting one that outranks it, swapped versus waiting, and the
step in flight that must not be scheduled ahead of such a preemption."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from import_checks import assert_imports_no_jax

from pagedjax.config import SchedulerConfig
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.request_queue import PriorityQueue, check_priority, new_queue
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4
_ids = iter(range(10**6))


def group(name: str, prompt_len: int, arrival: float, priority: int = 0) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(3, 3 + prompt_len)), BS)
    return SequenceGroup(name, [seq], arrival, SimpleNamespace(max_num_seqs=1), priority=priority)


def make(policy: str, num_blocks=64, budget=64, max_seqs=8, mode="recompute", host=64):
    bm = BlockManager(num_blocks, BS, num_host_blocks=host, watermark=0.0)
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, preemption_mode=mode, policy=policy
    )
    sched = Scheduler(bm, config)
    return bm, sched


def run_step(out, token: int = 7) -> None:
    for c in out.chunks:
        c.seq.num_computed_tokens += c.num_tokens
        if c.seq.num_computed_tokens == c.seq.get_len():
            c.seq.append_token_id(token)


def names(groups) -> list[str]:
    return [g.request_id for g in groups]


def test_the_policy_modules_import_no_jax():
    assert_imports_no_jax("pagedjax.core.request_queue")
    assert_imports_no_jax("pagedjax.core.scheduler")


def test_priority_queue_serves_lower_values_first_then_arrival():
    q = PriorityQueue()
    for name, arrival, priority in (("a", 0, 5), ("b", 1, 1), ("c", 2, 1), ("d", 0.5, 1)):
        q.append(group(name, 4, arrival, priority))
    assert names(q) == ["d", "b", "c", "a"]
    assert q[0].request_id == "d" and q[-1].request_id == "a"
    head = q.popleft()
    q.appendleft(group("e", 4, 9, 0))  # "put back first" still means: in its place by rank
    q.appendleft(head)
    assert names(q) == ["e", "d", "b", "c", "a"]
    q.remove(q[2])
    assert names(q) == ["e", "d", "c", "a"] and len(q) == 4
    with pytest.raises(ValueError):
        q.remove(group("zz", 4, 0))
    assert not PriorityQueue() and isinstance(new_queue("fcfs"), type(new_queue("fcfs")))


def test_priority_must_be_an_integer_and_needs_the_priority_policy():
    check_priority(0, "fcfs")
    check_priority(-3, "priority")
    with pytest.raises(ValueError, match=r"priority=2 needs the priority scheduling policy"):
        check_priority(2, "fcfs")
    for bad in (1.5, True, "1", None):
        with pytest.raises(ValueError, match="priority must be an integer"):
            check_priority(bad, "priority")
    with pytest.raises(ValueError, match="policy must be one of"):
        make("lifo")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order_follows_the_policy(policy):
    _, sched = make(policy, max_seqs=1)
    sched.add(group("late-low", 4, 0.0, priority=5))
    sched.add(group("high-b", 4, 2.0, priority=1))
    sched.add(group("high-a", 4, 1.0, priority=1))
    admitted = []
    for _ in range(3):
        out = sched.schedule()
        admitted += [c.group.request_id for c in out.chunks if c.seq.num_computed_tokens == 0]
        run_step(out)
        for g in list(sched.running):  # each finishes after its first token
            sched.finish_seq(g.get_seqs()[0], "length")
        sched.drop_finished()
    expected = {
        "fcfs": ["late-low", "high-b", "high-a"],
        "priority": ["high-a", "high-b", "late-low"],
    }
    assert admitted == expected[policy]


@pytest.mark.parametrize(
    "policy, victim", [("fcfs", "later-urgent"), ("priority", "earlier-background")]
)
def test_the_running_group_preempted_for_blocks_follows_the_policy(policy, victim):
    # 4 blocks of 4 slots: two groups of 8 tokens fill the pool; the next decode needs a block.
    bm, sched = make(policy, num_blocks=5)
    sched.add(group("earlier-background", 8, 0.0, priority=9))
    sched.add(group("later-urgent", 8, 1.0, priority=0))
    out = sched.schedule()
    assert len(out.chunks) == 2 and bm.get_num_free_blocks() == 0
    run_step(out)
    out = sched.schedule()
    assert names(out.preempted) == [victim]
    assert [c.group.request_id for c in out.chunks] == [
        n for n in ("earlier-background", "later-urgent") if n != victim
    ]
    assert names(sched.waiting) == [victim]


def test_a_waiting_group_that_outranks_a_running_one_preempts_it_when_blocks_run_out():
    bm, sched = make("priority", num_blocks=5)
    low = group("background", 14, 0.0, priority=5)
    sched.add(low)
    run_step(sched.schedule())
    assert bm.get_num_free_blocks() == 0  # 15 tokens in 4 blocks
    urgent = group("interactive", 6, 1.0, priority=0)
    sched.add(urgent)
    assert sched.priority_inversion() and not sched.in_flight.can_schedule_ahead()
    out = sched.schedule()
    assert names(out.preempted) == ["background"]
    assert [(c.group.request_id, c.num_tokens) for c in out.chunks] == [("interactive", 6)]
    assert low.get_seqs()[0].status is SequenceStatus.WAITING
    assert names(sched.waiting) == ["background"] and sched.num_preemptions == 1
    assert not sched.priority_inversion()


def test_fcfs_and_equal_or_lower_priority_never_preempt_for_a_waiting_group():
    for policy, priority in (("fcfs", 0), ("priority", 5), ("priority", 9)):
        bm, sched = make(policy, num_blocks=5)
        sched.add(group("first", 14, 0.0, priority=5))
        run_step(sched.schedule())
        sched.add(group("second", 6, 1.0, priority=priority))
        assert not sched.priority_inversion()
        out = sched.schedule()
        assert not out.preempted and names(sched.waiting) == ["second"], policy
        assert [c.group.request_id for c in out.chunks] == ["first"]


def test_max_num_seqs_also_makes_room_for_a_higher_priority_request():
    _, sched = make("priority", max_seqs=1)
    sched.add(group("batch-job", 4, 0.0, priority=3))
    run_step(sched.schedule())
    sched.add(group("user", 4, 1.0, priority=1))
    out = sched.schedule()
    assert names(out.preempted) == ["batch-job"]
    assert [c.group.request_id for c in out.chunks] == ["user"]


def test_a_waiting_group_that_outranks_the_first_swapped_one_is_admitted_before_it():
    # swap preemption: the background group goes to host memory, and the urgent one, which
    # outranks it, is admitted at once rather than behind its swap-in
    bm, sched = make("priority", num_blocks=5, mode="swap")
    low = group("background", 14, 0.0, priority=5)
    sched.add(low)
    run_step(sched.schedule())
    sched.add(group("interactive", 6, 1.0, priority=0))
    out = sched.schedule()
    assert names(out.preempted) == ["background"] and out.blocks_to_swap_out
    assert names(sched.swapped) == ["background"]
    assert [c.group.request_id for c in out.chunks] == ["interactive"]
    assert not out.blocks_to_swap_in


def test_a_priority_scheduler_pickles_with_its_queues_in_order():
    import pickle

    _, sched = make("priority", max_seqs=1)
    for name, priority in (("c", 3), ("a", 1), ("b", 2)):
        sched.add(group(name, 4, 0.0, priority=priority))
    copy = pickle.loads(pickle.dumps(sched))
    assert names(copy.waiting) == ["a", "b", "c"] and copy.policy == "priority"
    copy.waiting.append(group("first", 4, 9.0, priority=0))
    assert copy.waiting[0].request_id == "first"
