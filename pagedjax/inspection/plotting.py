"""Matplotlib drawings of the engine's memory, from the views of ``engine.inspect()``.

``draw_block_tables`` draws sequences' block tables (one row per sequence, one cell per logical
block), ``draw_pool`` the physical pool, ``plot_history`` memory and queues over the recorded
steps. matplotlib is imported when one is called, never by ``import pagedjax``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pagedjax.inspection.state import EngineView, PoolView, RequestView, StepRecord

_STATE_COLORS = {"null": "#222222", "free": "#eeeeee", "cached": "#9ecae1"}
_SHARED = "#fdd835"  # a used block held by several requests (or by none, given a PoolView)


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def _requests(what) -> list[RequestView]:
    if isinstance(what, EngineView):
        return list(what.requests.values())
    if isinstance(what, RequestView):
        return [what]
    return list(what)


def draw_block_tables(
    requests: EngineView | RequestView | Iterable[RequestView], ax=None, title: str | None = None
):
    """One row per sequence, one cell per logical block: the physical block id (also the colour),
    the slots that hold tokens, and the ref count when the block is shared. Swapped-out tables
    (host block ids) are hatched; a finished sequence's released table is faded."""
    import matplotlib.pyplot as plt

    rows = [(r, s) for r in _requests(requests) for s in r.sequences]
    width = max([len(s.block_table) for _, s in rows] + [1])
    ax = _axes(ax, (max(6.0, 1.1 * width + 2.5), 0.6 + 0.55 * max(len(rows), 1)))
    for row, (r, s) in enumerate(rows):
        refs = s.ref_counts or (0,) * len(s.block_table)
        for i, (block, tokens, ref) in enumerate(
            zip(s.block_table, s.tokens_per_block, refs, strict=True)
        ):
            ax.add_patch(
                plt.Rectangle(
                    (i, -row),
                    0.95,
                    0.8,
                    facecolor=plt.cm.tab20(block % 20),
                    alpha=0.35 if s.location == "released" else 1.0,
                    hatch="//" if s.location == "host" else None,
                    edgecolor="black" if ref > 1 else "none",
                    linewidth=2 if ref > 1 else 0,
                )
            )
            label = f"{'h' if s.location == 'host' else '#'}{block}\n{tokens} tok"
            ax.text(
                i + 0.47,
                -row + 0.4,
                label + (f" r{ref}" if ref > 1 else ""),
                ha="center",
                va="center",
                fontsize=7,
            )
        status = s.finish_reason or s.status
        ax.text(
            -0.15,
            -row + 0.4,
            f"{r.request_id} / seq {s.seq_id}\n{status}, {s.num_tokens} tok",
            ha="right",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(-3.2, width + 0.1)
    ax.set_ylim(-max(len(rows), 1) + 0.7, 0.95)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_pool(pool: EngineView | PoolView, ax=None, title: str | None = None, columns=None):
    """Every physical block of the device pool: free (light), cached prefix blocks (blue), used
    ones coloured by the request holding them (given an EngineView; yellow when several requests
    hold one) with their filled slots, shared ones outlined with their ref count. Block 0 is the
    null block (black)."""
    import matplotlib.pyplot as plt

    view = pool if isinstance(pool, EngineView) else None
    pool = view.pool if view else pool
    owners: dict[int, set[str]] = {}
    if view is not None:
        for r in view.requests.values():
            for s in r.sequences:
                if s.location == "device":
                    for b in s.block_table:
                        owners.setdefault(b, set()).add(r.request_id)
    names = sorted({r for held in owners.values() for r in held})
    palette = [plt.cm.tab10(i) for i in (1, 2, 3, 4, 5, 6, 8)]  # no blue: blue is the cache's
    n = pool.num_blocks
    cols = columns or max(8, math.ceil(math.sqrt(2 * n)))
    nrows = math.ceil(n / cols)
    ax = _axes(ax, (min(14.0, 0.45 * cols + 1), 0.45 * nrows + 1))
    for b, (state, ref, tokens) in enumerate(
        zip(pool.state, pool.ref_counts, pool.tokens, strict=True)
    ):
        x, y = b % cols, -(b // cols)
        held = owners.get(b, ())
        if state == "used":
            color = palette[names.index(next(iter(held))) % 7] if len(held) == 1 else _SHARED
        else:
            color = _STATE_COLORS[state]
        ax.add_patch(
            plt.Rectangle(
                (x, y),
                0.92,
                0.92,
                facecolor=color,
                edgecolor="black" if ref > 1 else "#bbbbbb",
                linewidth=2 if ref > 1 else 0.5,
            )
        )
        if state in ("used", "cached"):
            fill = tokens / pool.block_size
            ax.add_patch(plt.Rectangle((x + 0.06, y + 0.06), 0.8 * fill, 0.1, color="black"))
            ax.text(
                x + 0.46,
                y + 0.52,
                f"{b}" + (f" r{ref}" if ref > 1 else ""),
                ha="center",
                va="center",
                fontsize=6,
            )
    handles = [plt.Rectangle((0, 0), 1, 1, color=_STATE_COLORS[s]) for s in ("free", "cached")]
    labels = ["free", "cached (prefix)"]
    if any(len(held) > 1 for held in owners.values()):
        handles.append(plt.Rectangle((0, 0), 1, 1, color=_SHARED))
        labels.append("used by several requests")
    for name in names[:12]:
        handles.append(plt.Rectangle((0, 0), 1, 1, color=palette[names.index(name) % 7]))
        labels.append(name)
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_xlim(-0.1, cols)
    ax.set_ylim(-nrows + 0.9, 1.0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        title
        or f"pool: {pool.num_used} used, {pool.num_cached} cached, {pool.num_free} free "
        f"(bar: filled slots of {pool.block_size})",
        fontsize=10,
    )
    return ax


def plot_history(steps: Sequence[StepRecord], axes=None, x: str = "step"):
    """Two panels over the recorded steps (``engine.history.steps``): device and host blocks in
    use (preemptions marked), and the queues. ``x`` is "step" or "time" (seconds)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    mem, queues = axes
    xs = [r.step if x == "step" else r.time for r in steps]
    mem.stackplot(
        xs,
        [r.num_used for r in steps],
        [r.num_cached for r in steps],
        labels=["used", "cached (prefix)"],
        colors=["#fd8d3c", "#9ecae1"],
        step="post",
    )
    total = steps[0].num_used + steps[0].num_cached + steps[0].num_free if steps else 0
    mem.axhline(total, color="black", linewidth=0.8, linestyle=":", label="device blocks")
    mem.step(
        xs,
        [r.num_host_used for r in steps],
        where="post",
        color="C4",
        label="host blocks (swapped)",
    )
    for kind, marker, color in (("recompute", "v", "C3"), ("swap", "s", "C4")):
        pts = [
            (xv, r.num_used)
            for xv, r in zip(xs, steps, strict=True)
            if any(m == kind for _, m in r.preempted)
        ]
        if pts:
            mem.scatter(
                *zip(*pts, strict=True),
                marker=marker,
                color=color,
                zorder=3,
                label=f"preempted ({kind})",
            )
    mem.set_ylabel("blocks")
    mem.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for name, color in (("running", "C2"), ("waiting", "C1"), ("swapped", "C4")):
        queues.step(
            xs, [getattr(r, f"num_{name}") for r in steps], where="post", color=color, label=name
        )
    queues.set_ylabel("requests")
    queues.set_xlabel("engine step" if x == "step" else "seconds")
    queues.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return axes
