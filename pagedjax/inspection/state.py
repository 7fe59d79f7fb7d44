"""A per-step record of the engine, its read-only views (``views.py``), snapshot / replay.

``engine.inspect()`` returns an ``EngineView`` built at the moment of the call: per request its
sequences, block tables, tokens per block and ref counts; the pool; the queues; the last step's
record. A finished request keeps its last state for the last ``History.max_finished`` requests.
``engine.snapshot()`` captures the host-side state (``LLMEngine.state()``: scheduler with its block
manager, requests, seed generator, history) and the KV blocks that hold data
(``KVCache.export_blocks``); ``engine.restore(snapshot)`` checks the snapshot against the engine,
then puts it in that state (``LLMEngine.load_state``, ``KVCache.import_blocks``), and its next
steps produce the same tokens (sampling is keyed by each request's seed and the token's position).
``diff(a, b)`` lists what differs between two snapshots or views. Not covered: multi-process runs,
and ``preemption_mode="auto"`` (it decides from timings, which a replay measures anew).

This module reads exported state only (``BlockManager.view()`` / ``usage()``, the scheduler's
queues, the request table, ``KVCache.export_blocks``); it never imports the engine.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import itertools
import pickle
import re
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pagedjax.core.block_view import BlockManagerView
from pagedjax.core.scheduler import SchedulerOutput
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedjax.inspection.views import (
    EngineView,
    PoolView,
    RequestView,
    SequenceView,
    StepRecord,
)

if TYPE_CHECKING:
    from pagedjax.core.scheduler import Scheduler


class Request(Protocol):
    """What the views read of one of the engine's requests (engine/request.py's Request)."""

    prompt: str | None
    error: str | None  # why the engine ended it, if it did
    group: SequenceGroup


class StateSource(Protocol):
    """What the step record reads: the engine, or an ``EngineState``."""

    scheduler: Scheduler
    requests: dict[str, Request]


@dataclasses.dataclass
class EngineState:
    """The engine's host-side state (``LLMEngine.state()`` / ``load_state()``)."""

    scheduler: Scheduler  # with its block manager
    requests: dict[str, Request]
    rng: np.random.Generator  # seeds of requests that give none
    history: History


# ---- building views from exported state --------------------------------------------------------


def _seq_view(
    bv: BlockManagerView | None, bs: int, seq: Sequence, released: list[int] | None = None
) -> SequenceView:
    """bv None: seq holds no blocks (a finished one: finishing frees them)."""
    if bv is not None and seq.seq_id in bv.tables:
        location, table = "device", bv.tables[seq.seq_id]
        tokens = [bv.num_tokens[b] for b in table]
        refs = tuple(bv.ref_counts[b] for b in table)
    elif bv is not None and seq.seq_id in bv.host_tables:
        location, table = "host", bv.host_tables[seq.seq_id]
        tokens = [bv.host_num_tokens[h] for h in table]
        refs = tuple(bv.host_ref_counts[h] for h in table)
    else:
        location = "released" if seq.is_finished() else "none"
        table = (released or []) if seq.is_finished() else []
        n = seq.num_computed_tokens
        tokens = [min(bs, max(0, n - i * bs)) for i in range(len(table))]
        refs = ()
    return SequenceView(
        seq_id=seq.seq_id,
        status=seq.status.name.lower(),
        token_ids=tuple(seq.get_token_ids()),
        num_prompt_tokens=seq.get_prompt_len(),
        num_computed_tokens=seq.num_computed_tokens,
        location=location,
        block_table=tuple(table),
        tokens_per_block=tuple(tokens),
        ref_counts=refs,
        finish_reason=seq.finish_reason,
        cumulative_logprob=seq.cumulative_logprob,
        text=seq.text,
    )


def _request_view(
    blocks: tuple[BlockManagerView | None, int],
    history: History,
    group: SequenceGroup,
    status: str,
    req: Request | None = None,
) -> RequestView:
    seqs = sorted(group.get_seqs(), key=lambda s: s.seq_id)
    first = seqs[0]
    return RequestView(
        request_id=group.request_id,
        status=status,
        prompt=req.prompt if req is not None else None,
        num_prompt_tokens=first.get_prompt_len(),
        num_cached_tokens=history.cached_tokens.get(group.request_id, 0),
        sequences=tuple(_seq_view(*blocks, s, history.tables.get(s.seq_id)) for s in seqs),
        error=req.error if req is not None else group.abort_reason,
    )


def _pool_view(bv: BlockManagerView) -> PoolView:
    state = tuple(bv.block_state(b) for b in range(bv.num_blocks))
    usage = bv.usage
    return PoolView(
        block_size=bv.block_size,
        num_blocks=bv.num_blocks,
        num_used=usage.num_used,
        num_cached=usage.num_cached,
        num_free=usage.num_free,
        watermark_blocks=bv.watermark_blocks,
        num_host_blocks=bv.num_host_blocks,
        num_host_used=usage.num_host_used,
        ref_counts=bv.ref_counts,
        tokens=tuple(
            n if refs or s == "cached" else 0
            for n, refs, s in zip(bv.num_tokens, bv.ref_counts, state, strict=True)
        ),
        state=state,
    )


def inspect(state: EngineState) -> EngineView:
    """A read-only view of the engine's requests, pool and queues now (see the module doc)."""
    history, sched = state.history, state.scheduler
    history.settle(state)
    bv = sched.bm.view()
    queue_of = {
        g.request_id: name
        for name, queue in (
            ("waiting", sched.waiting),
            ("running", sched.running),
            ("swapped", sched.swapped),
        )
        for g in queue
    }
    requests = {
        rid: _request_view(
            (bv, bv.block_size),
            history,
            req.group,
            "finished" if req.group.is_finished() else queue_of.get(rid, "?"),
            req,
        )
        for rid, req in state.requests.items()
    }
    return EngineView(
        step=history.num_steps,
        requests=requests,
        finished=dict(history.finished),
        waiting=tuple(g.request_id for g in sched.waiting),
        running=tuple(g.request_id for g in sched.running),
        swapped=tuple(g.request_id for g in sched.swapped),
        pool=_pool_view(bv),
        last_step=history.steps[-1] if history.steps else None,
    )


# ---- the per-step record -----------------------------------------------------------------------


class History:
    """The engine's memory of its recent steps: the last ``max_steps`` StepRecords and the last
    state of the last ``max_finished`` finished requests. ``record`` runs once per step, right
    after scheduling; its cost is one pass over the step's chunks."""

    def __init__(self, max_steps: int = 1024, max_finished: int = 256):
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self.max_finished = max_finished
        self.finished: collections.OrderedDict[str, RequestView] = collections.OrderedDict()
        self.num_steps = 0
        self.start = time.perf_counter()
        self.cached_tokens: dict[str, int] = {}  # request id -> prefix-cache hit tokens
        self.tables: dict[int, list[int]] = {}  # seq id -> its block table in the last step
        # Scheduled in the last step: request id -> (its group, its Request if still known).
        self._last: dict[str, tuple[SequenceGroup, Request | None]] = {}

    def record(self, source: StateSource, out: SchedulerOutput) -> SchedulerOutput:
        """Keep what ``out`` scheduled; returns ``out``."""
        self.settle(source)
        sched = source.scheduler
        self.num_steps += 1
        preempted = []
        for g in out.preempted:
            swapped = any(s.status is SequenceStatus.SWAPPED for s in g.get_seqs())
            preempted.append((g.request_id, "swap" if swapped else "recompute"))
            if not swapped:  # its prompt is admitted again, maybe with other cache hits
                self.cached_tokens.pop(g.request_id, None)
        for c in out.chunks:
            # A request's first chunk after admission starts where its prefix-cache hits end.
            self.cached_tokens.setdefault(c.group.request_id, c.seq.num_computed_tokens)
        self._last = {
            g.request_id: (g, source.requests.get(g.request_id))
            for g in [c.group for c in out.chunks] + out.aborted
        }
        # The table lists themselves (BlockManager.table_of): a finished sequence's list is
        # dropped unchanged, so it keeps the last table the sequence held.
        self.tables = {c.seq.seq_id: sched.bm.table_of(c.seq.seq_id) for c in out.chunks}
        usage = sched.bm.usage()
        self.steps.append(
            StepRecord(
                step=self.num_steps,
                time=time.perf_counter() - self.start,
                scheduled=tuple(
                    (c.group.request_id, c.seq.seq_id, c.seq.num_computed_tokens, c.num_tokens)
                    for c in out.chunks
                ),
                preempted=tuple(preempted),
                aborted=tuple(g.request_id for g in out.aborted),
                blocks_swapped_out=tuple(out.blocks_to_swap_out),
                blocks_swapped_in=tuple(out.blocks_to_swap_in),
                blocks_copied=tuple(out.blocks_to_copy),
                num_used=usage.num_used,
                num_cached=usage.num_cached,
                num_free=usage.num_free,
                num_host_used=usage.num_host_used,
                num_waiting=len(sched.waiting),
                num_running=len(sched.running),
                num_swapped=len(sched.swapped),
            )
        )
        return out

    def settle(self, source: StateSource) -> None:
        """Keep the last state of the requests that the last step finished."""
        done = [
            (rid, group, req)
            for rid, (group, req) in self._last.items()
            if group.is_finished() and (req is None or req.group is group)
        ]
        bs = source.scheduler.bm.block_size
        for rid, group, req in done:  # their sequences hold no blocks: no pool view needed
            self.finished[rid] = _request_view((None, bs), self, group, "finished", req)
            self.finished.move_to_end(rid)
            self.cached_tokens.pop(rid, None)
        self._last = {}
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)
        requests = source.requests
        if len(self.cached_tokens) > 2 * len(requests) + 64:  # aborted while waiting
            self.cached_tokens = {r: n for r, n in self.cached_tokens.items() if r in requests}


# ---- snapshot and replay -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The engine's state after ``step`` steps; ``save`` / ``Snapshot.load`` keep it in a file."""

    step: int
    view: EngineView  # what inspect() showed at that moment (diff compares these)
    config: object  # the EngineConfig: restore needs an engine built the same way
    state: bytes  # pickled (scheduler with its block manager, requests, seed generator, history)
    device_blocks: tuple[int, ...]  # device blocks holding data (used or cached)
    kv: tuple[np.ndarray, np.ndarray] | None  # their K and V: [kv_heads, layers, n, bs, head_dim]
    host_blocks: tuple[int, ...]  # host (swap space) blocks holding data
    # Their K and V per slice of kv heads, as the runner keeps them: [heads, layers, n, bs, hd].
    host_kv: dict[tuple[int, int], tuple[np.ndarray, ...]]  # per pool array (8-bit: + scales)

    def save(self, path) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load(path) -> Snapshot:
        with open(path, "rb") as f:
            snap = pickle.load(f)
        if not isinstance(snap, Snapshot):
            raise ValueError(f"{path} holds a {type(snap).__name__}, not a Snapshot")
        return snap

    def _repr_html_(self) -> str:
        return f"<b>snapshot at step {self.step}</b><br>" + self.view._repr_html_()


class _Pickler(pickle.Pickler):
    """Pickles the scheduler's seq-id counter by its next value (itertools drops pickle support
    for its iterators in Python 3.14)."""

    def reducer_override(self, obj):
        if type(obj) is itertools.count:
            start = re.fullmatch(r"count\((-?\d+)\)", repr(obj))
            if start is None:
                raise ValueError(f"cannot snapshot {obj!r}")
            return itertools.count, (int(start[1]),)
        return NotImplemented


def snapshot(state: EngineState, config, kv_cache) -> Snapshot:
    """Capture an engine's state between steps (see the module doc): its host-side ``state``,
    the ``config`` it was built with, and its ``kv_cache``'s blocks that hold data."""
    if config.lora is not None:  # adapters live in the runner's slots, not the pool
        raise ValueError("snapshots cover engines without enable_lora only")
    view = inspect(state)
    buf = io.BytesIO()
    pickled = (state.scheduler, state.requests, state.rng, state.history)
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(pickled)
    blocks = tuple(b for b, s in enumerate(view.pool.state) if s in ("used", "cached"))
    host_blocks = state.scheduler.bm.view().host_blocks_in_use
    kv, host_kv = kv_cache.export_blocks(blocks, host_blocks)
    return Snapshot(
        step=view.step,
        view=view,
        config=config,
        state=buf.getvalue(),
        device_blocks=blocks,
        kv=kv,
        host_blocks=host_blocks,
        host_kv=host_kv,
    )


def load(snap: Snapshot, config) -> EngineState:
    """The host-side state held in ``snap``, for an engine built with ``config``; raises
    ValueError (and changes nothing anywhere) if the snapshot was taken on another
    configuration. The snapshot itself is left as it was."""
    if config != snap.config:
        raise ValueError(
            f"the snapshot was taken on an engine configured {snap.config}, not {config}"
        )
    return EngineState(*pickle.loads(snap.state))


# ---- diff --------------------------------------------------------------------------------------


def diff(a: Snapshot | EngineView, b: Snapshot | EngineView) -> list[str]:
    """What differs from ``a`` to ``b``, one readable line per difference ([] if nothing)."""
    va = a.view if isinstance(a, Snapshot) else a
    vb = b.view if isinstance(b, Snapshot) else b
    lines = []
    if va.step != vb.step:
        lines.append(f"step: {va.step} -> {vb.step}")
    for name in ("waiting", "running", "swapped"):
        qa, qb = getattr(va, name), getattr(vb, name)
        if qa != qb:
            lines.append(f"{name}: {list(qa)} -> {list(qb)}")
    pa, pb = va.pool, vb.pool
    counts = [
        f"{name} {x} -> {y}"
        for name in ("num_used", "num_cached", "num_free", "num_host_used")
        if (x := getattr(pa, name)) != (y := getattr(pb, name))
    ]
    if counts:
        lines.append("pool: " + ", ".join(c.removeprefix("num_") for c in counts))
    ra, rb = {**va.finished, **va.requests}, {**vb.finished, **vb.requests}
    for rid in list(ra) + [r for r in rb if r not in ra]:
        if rid not in rb:
            lines.append(f"- request {rid!r} ({ra[rid].status})")
        elif rid not in ra:
            lines.append(f"+ request {rid!r} ({rb[rid].status})")
        else:
            lines += _request_diff(ra[rid], rb[rid])
    if isinstance(a, Snapshot) and isinstance(b, Snapshot):
        lines += _kv_diff(a, b)
    return lines


def _request_diff(a: RequestView, b: RequestView) -> list[str]:
    name = f"request {a.request_id!r}"
    lines = [f"{name}: {a.status} -> {b.status}"] if a.status != b.status else []
    sa = {s.seq_id: s for s in a.sequences}
    sb = {s.seq_id: s for s in b.sequences}
    for seq_id in list(sa) + [s for s in sb if s not in sa]:
        if seq_id not in sb or seq_id not in sa:
            sign, s = ("-", sa[seq_id]) if seq_id in sa else ("+", sb[seq_id])
            lines.append(f"{name} {sign} seq {seq_id} ({s.status}, {s.num_tokens} tokens)")
            continue
        x, y = sa[seq_id], sb[seq_id]
        where = f"{name} seq {seq_id}"
        if x.status != y.status:
            lines.append(f"{where}: {x.status} -> {y.status}")
        first = next(
            (i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids, strict=False)) if p != q),
            min(len(x.token_ids), len(y.token_ids)),
        )
        if x.token_ids != y.token_ids:
            grown = first == min(len(x.token_ids), len(y.token_ids))
            change = (
                f"+{list(y.token_ids[first:])}"
                if grown and len(y.token_ids) > len(x.token_ids)
                else f"differ from position {first}: {list(x.token_ids[first : first + 4])}.. vs "
                f"{list(y.token_ids[first : first + 4])}.."
            )
            lines.append(f"{where}: tokens {x.num_tokens} -> {y.num_tokens} ({change})")
        if x.num_computed_tokens != y.num_computed_tokens:
            lines.append(f"{where}: computed {x.num_computed_tokens} -> {y.num_computed_tokens}")
        if (x.location, x.block_table) != (y.location, y.block_table):
            lines.append(
                f"{where}: blocks {x.location} {list(x.block_table)} -> "
                f"{y.location} {list(y.block_table)}"
            )
    return lines


def _kv_diff(a: Snapshot, b: Snapshot) -> list[str]:
    """Device blocks held in both snapshots whose K or V contents differ."""
    if a.kv is None or b.kv is None:
        return []
    ia = {blk: i for i, blk in enumerate(a.device_blocks)}
    changed = [
        blk
        for j, blk in enumerate(b.device_blocks)
        if blk in ia
        and any(
            not np.array_equal(x[:, :, ia[blk]], y[:, :, j], equal_nan=True)
            for x, y in zip(a.kv, b.kv, strict=True)
        )
    ]
    return [f"kv: blocks with other contents: {changed}"] if changed else []
