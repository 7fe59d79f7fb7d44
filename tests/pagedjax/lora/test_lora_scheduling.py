"""Admission by adapter slots (core/lora_admission.py) and the prefix cache keyed by adapter, as
plain Python on the scheduler and block manager."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from pagedjax import LoRARequest
from pagedjax.config import SchedulerConfig
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.lora_admission import LoRAAdmission
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedjax.lora import LoRAConfig, LoRAManager

BS = 4
_ids = itertools.count()


def lora(i: int) -> LoRARequest | None:
    return None if i == 0 else LoRARequest(f"a{i}", i, f"/adapters/{i}")


def group(name, prompt, adapter: int, arrival: float) -> SequenceGroup:
    seq = Sequence(next(_ids), prompt, BS)
    return SequenceGroup(name, [seq], arrival, SimpleNamespace(max_num_seqs=1), lora(adapter))


def make(max_loras=2, num_blocks=128, budget=64, max_seqs=8, max_skips=16):
    slots: dict[int, str] = {}  # what each device slot holds, as load_slot wrote it
    manager = LoRAManager(
        LoRAConfig(max_loras=max_loras, max_lora_rank=8),
        loader=lambda path, mc, rank: SimpleNamespace(rank=4, path=path),
        load_slot=lambda slot, adapter: slots.__setitem__(slot, adapter.path),
    )
    bm = BlockManager(num_blocks, BS, watermark=0.0, enable_prefix_caching=True)
    sched = Scheduler(
        bm,
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
        lora=LoRAAdmission(manager, max_skips=max_skips),
    )
    return sched, manager, slots


def step(sched, slots, out_len: int) -> list:
    """Schedule, check the adapters of the batch, then what the engine does after a step."""
    out = sched.schedule()
    adapters = {c.group.lora_int_id for c in out.chunks} - {0}
    assert len(adapters) <= sched.lora.manager.max_loras, adapters
    for c in out.chunks:
        if c.group.lora_request is None:
            assert c.lora_slot == 0
        else:  # the slot the runner reads holds this group's adapter
            assert c.lora_slot >= 1 and slots[c.lora_slot] == c.group.lora_request.lora_path
        completes = c.completes
        c.seq.num_computed_tokens += c.num_tokens
        sched.bm.mark_blocks_computed(c.seq)
        if completes:
            c.seq.append_token_id(7)
            if c.seq.get_output_len() >= out_len:
                sched.finish_seq(c.seq, "length")
    sched.drop_finished()
    return out


def test_more_adapters_than_slots_every_request_finishes():
    sched, manager, slots = make(max_loras=2)
    adapters = [1, 2, 3, 0, 1, 4, 5, 2, 0, 3, 6, 1]
    groups = [group(f"r{i}", [10 + i] * 6, a, i) for i, a in enumerate(adapters)]
    for g in groups:
        sched.add(g)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched, slots, out_len=3)
    assert not sched.has_unfinished()
    assert all(g.is_finished() and g.get_seqs()[0].finish_reason == "length" for g in groups)
    assert manager.num_slot_loads >= 6  # six adapters through two slots


def test_a_request_whose_adapter_does_not_fit_waits_and_later_ones_that_fit_go():
    sched, _, slots = make(max_loras=1)
    for i, a in enumerate([1, 2, 1, 0]):
        sched.add(group(f"r{i}", [20 + i] * 5, a, i))
    out = step(sched, slots, out_len=4)
    # r1's adapter 2 would be a second adapter: it waits; r2 (adapter 1) and r3 (base) go
    assert [c.group.request_id for c in out.chunks] == ["r0", "r2", "r3"]
    assert [g.request_id for g in sched.waiting] == ["r1"]
    while sched.has_unfinished():
        out = step(sched, slots, out_len=4)
    assert sched.waiting == type(sched.waiting)()


def test_a_passed_over_request_is_not_starved_by_the_adapters_in_the_batch():
    sched, _, slots = make(max_loras=1, max_skips=2)
    sched.add(group("first", [1] * 5, 1, 0))
    starved = group("other", [2] * 5, 2, 1)
    sched.add(starved)
    arrivals = itertools.count(2)
    for _ in range(30):  # a steady stream of adapter-1 requests, one per step
        sched.add(group(f"more{next(arrivals)}", [3] * 5, 1, next(arrivals)))
        step(sched, slots, out_len=3)
        if starved in sched.running or starved.is_finished():
            break
    assert starved in sched.running or starved.is_finished()
    assert starved.num_lora_skips >= 2


def test_a_swapped_group_waits_for_an_adapter_slot():
    sched, manager, slots = make(max_loras=1)
    a = group("a", [5] * 4, 1, 0)
    sched.add(a)
    step(sched, slots, out_len=10)
    # a is swapped out by hand (as preemption would), b takes the only slot meanwhile
    sched.running.remove(a)
    sched.bm.swap_out(a) if sched.bm.num_host_blocks else None
    a.get_seqs()[0].status = SequenceStatus.SWAPPED
    sched.swapped.append(a)
    assert not sched.lora.should_wait(a, [], [])
    b = group("b", [6] * 4, 2, 1)
    sched.running.append(b)
    manager.activate(b.lora_request, set())
    assert sched.lora.should_wait(a, sched.running, [])


def test_an_adapter_that_cannot_load_any_more_aborts_its_request_alone():
    sched, manager, slots = make(max_loras=1)
    manager.loader = lambda path, mc, rank: (_ for _ in ()).throw(ValueError(f"gone: {path}"))
    bad, good = group("bad", [1] * 4, 3, 0), group("good", [2] * 4, 0, 1)
    sched.add(bad)
    sched.add(good)
    out = sched.schedule()
    assert [g.request_id for g in out.aborted] == ["bad"]
    assert "gone: /adapters/3" in bad.abort_reason
    assert [c.group.request_id for c in out.chunks] == ["good"]


# ---- the prefix cache, keyed by adapter --------------------------------------------------------


def cached_run(bm: BlockManager, prompt, adapter: int) -> tuple[int, list[int]]:
    """Allocate a one-seq group, compute its prompt, free it: (tokens it found cached, table)."""
    g = group(f"p{next(_ids)}", prompt, adapter, 0)
    seq = g.get_seqs()[0]
    bm.allocate(g)
    hit = seq.num_computed_tokens
    table = bm.get_block_table(seq)
    seq.num_computed_tokens = seq.get_len()
    bm.mark_blocks_computed(seq)
    bm.free(seq)
    return hit, table


@pytest.mark.parametrize("first,second", [(1, 2), (1, 0), (0, 1)])
def test_a_prefix_block_is_never_shared_across_adapters(first, second):
    bm = BlockManager(64, BS, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(1, 14))  # three full blocks and a token
    hit, table = cached_run(bm, prompt, first)
    assert hit == 0
    hit, other = cached_run(bm, prompt, second)
    assert hit == 0, f"adapter {second} reused {hit} tokens computed under adapter {first}"
    assert not set(table[:3]) & set(other[:3])
    hit, again = cached_run(bm, prompt, first)  # the same adapter does hit its own blocks
    assert hit == 12 and again[:3] == table[:3]
