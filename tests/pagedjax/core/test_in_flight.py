"""The scheduler's account of a step in flight (core/in_flight.py): counted ahead with placeholder
tokens, the next schedule sees the lengths a finished step would leave, and retreating restores
everything; the step loop touches sequences only through it."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedjax.config import SchedulerConfig
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.in_flight import placeholder
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceGroup

BS = 4
ROOT = Path(__file__).resolve().parents[3]


def _scheduler(num_blocks: int = 32) -> Scheduler:
    bm = BlockManager(num_blocks, BS, num_host_blocks=0, watermark=0.0)
    return Scheduler(bm, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))


def _add(sched: Scheduler, name: str, n: int) -> Sequence:
    seq = Sequence(sched.new_seq_id(), list(range(3, 3 + n)), BS)
    sched.add(SequenceGroup(name, [seq], 0.0, SimpleNamespace(max_num_seqs=1)))
    return seq


def test_advance_counts_the_step_and_retreat_undoes_it():
    sched = _scheduler()
    a, b = _add(sched, "a", 5), _add(sched, "b", 6)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [a, b]
    before = [(list(s.token_ids), s.num_computed_tokens) for s in (a, b)]
    assert sched.in_flight.advance(out.chunks, [1, 1])
    assert a.token_ids[-1] == placeholder(0) and b.token_ids[-1] == placeholder(1)
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 6)
    assert a.output_token_ids == [] and b.output_token_ids == []  # outputs stay real
    ahead = sched.schedule()  # the decodes of the placeholders, at the right positions
    assert [(c.seq, c.num_tokens) for c in ahead.chunks] == [(a, 1), (b, 1)]
    with pytest.raises(RuntimeError, match="in flight"):
        sched.in_flight.advance(out.chunks, [1, 1])
    sched.in_flight.retreat()
    assert [(list(s.token_ids), s.num_computed_tokens) for s in (a, b)] == before
    assert not sched.in_flight.advanced


def test_no_scheduling_ahead_when_the_pool_could_preempt():
    sched = _scheduler(num_blocks=3)
    _add(sched, "a", 4), _add(sched, "b", 4)
    sched.schedule()
    assert sched.bm.get_num_free_blocks() < 2
    assert not sched.in_flight.can_schedule_ahead()
    roomy = _scheduler()
    _add(roomy, "a", 4)
    roomy.schedule()
    assert roomy.in_flight.can_schedule_ahead()
    with pytest.raises(ValueError, match="row"):
        placeholder(-1)


def test_the_step_loop_edits_no_sequence_itself():
    """The step loop neither appends to a sequence's tokens nor sets its computed count."""
    tree = ast.parse((ROOT / "pagedjax" / "engine" / "step_loop.py").read_text())
    edits = [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.AugAssign) and "num_computed_tokens" in ast.dump(node.target))
        or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "pop")
            and "token_ids" in ast.dump(node.func.value)
        )
    ]
    assert edits == []
