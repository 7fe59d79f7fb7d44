"""The order in which queued requests are served (vLLM's ``--scheduling-policy``).

- ``fcfs``: arrival order. The waiting and swapped queues are deques; a group preempted for
  recompute goes back to the front of the waiting queue.
- ``priority``: by ``(priority, arrival_time)``, lower values first, ties by arrival. The queues
  keep that order whatever is added or put back, and the scheduler (core/scheduler.py) preempts
  the running group of the lowest priority (latest-arrived among equals) when blocks run out,
  also to admit a waiting group that outranks it (vLLM's priority preemption).

Pure Python; imports no jax.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Iterator

from pagedjax.core.sequence import SequenceGroup


def priority_key(group: SequenceGroup) -> tuple[int, float]:
    """The group's rank under the priority policy: smaller is served first."""
    return group.priority, group.arrival_time


def _reversed_key(group: SequenceGroup) -> tuple[int, float]:
    return -group.priority, -group.arrival_time


class PriorityQueue:
    """Groups in ``priority_key`` order: ``[0]`` is the next to serve. The deque methods the
    scheduler calls all keep that order (``append`` and ``appendleft`` both insert in place).
    Stored best-last, so that taking the head is a pop from the end."""

    def __init__(self, groups: Iterable[SequenceGroup] = ()):
        self._groups: list[SequenceGroup] = sorted(groups, key=_reversed_key)

    def append(self, group: SequenceGroup) -> None:
        # among equal keys the newcomer goes behind (towards the front of the list)
        bisect.insort_left(self._groups, group, key=_reversed_key)

    appendleft = append

    def extendleft(self, groups: Iterable[SequenceGroup]) -> None:
        for group in groups:
            self.append(group)

    def popleft(self) -> SequenceGroup:
        if not self._groups:
            raise IndexError("pop from an empty PriorityQueue")
        return self._groups.pop()

    def remove(self, group: SequenceGroup) -> None:
        for i in range(len(self._groups) - 1, -1, -1):
            if self._groups[i] is group:
                del self._groups[i]
                return
        raise ValueError(f"{group!r} is not in the queue")

    def __getitem__(self, index: int) -> SequenceGroup:
        if not -len(self._groups) <= index < len(self._groups):
            raise IndexError("PriorityQueue index out of range")
        return self._groups[-1 - index]

    def __iter__(self) -> Iterator[SequenceGroup]:
        return reversed(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __repr__(self) -> str:
        return f"PriorityQueue({[g.request_id for g in self]})"


def new_queue(policy: str, groups: Iterable[SequenceGroup] = ()):
    """An empty (or filled) queue of the policy: a deque for ``fcfs``, a PriorityQueue for
    ``priority``."""
    if policy == "priority":
        return PriorityQueue(groups)
    return collections.deque(groups)


def arrival_key(group: SequenceGroup) -> float:
    return group.arrival_time


def running_order(policy: str):
    """The key running groups are served by (and preempted from the end of); module-level
    functions, so that a scheduler pickles (engine snapshots)."""
    return priority_key if policy == "priority" else arrival_key


def check_priority(priority, policy: str) -> None:
    """ValueError naming the value unless ``priority`` is an integer this policy takes: any
    under ``priority``, only 0 under ``fcfs`` (vLLM refuses it too)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority={priority} needs the priority scheduling policy "
            f"(scheduling_policy='priority', --scheduling-policy priority); this engine is {policy}"
        )
