"""The read-only views of the engine's memory that ``engine.inspect()`` returns: plain frozen
dataclasses (they never change after the call), each with an HTML table for notebooks."""

from __future__ import annotations

import dataclasses
import html

# ---- views --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SequenceView:
    seq_id: int
    status: str  # "waiting", "running", "swapped", "finished_stopped", ...
    token_ids: tuple[int, ...]  # prompt then output
    num_prompt_tokens: int
    num_computed_tokens: int  # leading tokens whose KV is in the pool
    # "device", "host" (swapped out), "none" (waiting), or "released": a finished sequence, with
    # the table it held in its last step (those blocks may hold other data by now).
    location: str
    block_table: tuple[int, ...]  # physical block ids (host block ids when location is "host")
    tokens_per_block: tuple[int, ...]  # slots holding a token, per entry of block_table
    ref_counts: tuple[int, ...]  # block tables holding each block; () once released
    finish_reason: str | None
    cumulative_logprob: float
    text: str

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str  # "waiting", "running", "swapped" or "finished"
    prompt: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache at its last admission
    sequences: tuple[SequenceView, ...]  # by seq_id
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def shared_blocks(self) -> tuple[int, ...]:
        """Physical blocks held by more than one block table (anyone's), in table order."""
        seen = {}
        for s in self.sequences:
            for b, r in zip(s.block_table, s.ref_counts, strict=False):
                if r > 1 and s.location == "device":
                    seen[b] = None
        return tuple(seen)

    def _repr_html_(self) -> str:
        head = (
            f"<b>request {html.escape(self.request_id)}</b>: {self.status}, "
            f"{self.num_prompt_tokens} prompt tokens ({self.num_cached_tokens} from the prefix "
            "cache)" + (f", error: {html.escape(self.error)}" if self.error else "")
        )
        return head + _sequences_table(self.sequences)


@dataclasses.dataclass(frozen=True)
class PoolView:
    block_size: int
    num_blocks: int  # device blocks, the null block 0 included
    num_used: int  # referenced by a block table
    num_cached: int  # free, but holding a computed prefix block that a prompt can hit
    num_free: int  # free and pristine
    watermark_blocks: int
    num_host_blocks: int
    num_host_used: int
    ref_counts: tuple[int, ...]  # per device block id
    tokens: tuple[int, ...]  # slots holding a token, per device block id
    state: tuple[str, ...]  # per device block id: "null", "free", "cached" or "used"

    def _repr_html_(self) -> str:
        rows = [
            ("device blocks", self.num_blocks - 1, "allocatable (block 0 is the null block)"),
            ("used", self.num_used, "held by a block table"),
            ("shared", sum(r > 1 for r in self.ref_counts), "held by several tables"),
            ("cached", self.num_cached, "free, holding a prefix the cache can hit"),
            ("free", self.num_free, "pristine"),
            ("host blocks used", self.num_host_used, f"of {self.num_host_blocks} (swap space)"),
        ]
        return _table(["", "blocks", ""], rows, f"<b>pool</b>: block size {self.block_size}")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one engine step scheduled, and the pool right after scheduling (before the step
    ran, so these are the step's peak)."""

    step: int  # 1 for the engine's first step
    time: float  # seconds since the engine was built (time.perf_counter)
    scheduled: tuple[tuple[str, int, int, int], ...]  # (request_id, seq_id, first token, tokens)
    preempted: tuple[tuple[str, str], ...]  # (request_id, "swap" or "recompute")
    aborted: tuple[str, ...]  # requests the scheduler gave up on
    blocks_swapped_out: tuple[tuple[int, int], ...]  # (device block, host block)
    blocks_swapped_in: tuple[tuple[int, int], ...]  # (host block, device block)
    blocks_copied: tuple[tuple[int, int], ...]  # copy-on-write (src, dst)
    num_used: int
    num_cached: int
    num_free: int
    num_host_used: int
    num_waiting: int
    num_running: int
    num_swapped: int

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for *_, n in self.scheduled)

    def _repr_html_(self) -> str:
        rows = [
            (r, s, f"{p}..{p + n - 1}" if n > 1 else str(p), n) for r, s, p, n in self.scheduled
        ]
        extra = ", ".join(
            f"{name}: {value}"
            for name, value in (
                ("preempted", self.preempted),
                ("aborted", self.aborted),
                ("swapped out", self.blocks_swapped_out),
                ("swapped in", self.blocks_swapped_in),
                ("copied", self.blocks_copied),
            )
            if value
        )
        title = (
            f"<b>step {self.step}</b>: {self.num_batched_tokens} tokens; blocks used "
            f"{self.num_used}, cached {self.num_cached}, free {self.num_free}; queues "
            f"{self.num_waiting} waiting / {self.num_running} running / {self.num_swapped} "
            f"swapped" + (f"<br>{html.escape(extra)}" if extra else "")
        )
        return _table(["request", "seq", "positions", "tokens"], rows, title)


@dataclasses.dataclass(frozen=True)
class EngineView:
    step: int  # steps the engine had run
    requests: dict[str, RequestView]  # unfinished, by request id
    finished: dict[str, RequestView]  # the last finished ones, oldest first
    waiting: tuple[str, ...]  # queues, in order of service
    running: tuple[str, ...]
    swapped: tuple[str, ...]
    pool: PoolView
    last_step: StepRecord | None

    def request(self, request_id: str) -> RequestView:
        """An unfinished request, else a finished one's last state."""
        view = self.requests.get(request_id) or self.finished.get(request_id)
        if view is None:
            raise KeyError(f"no request {request_id!r} in flight or among the last finished")
        return view

    __getitem__ = request

    def _repr_html_(self) -> str:
        queues = ", ".join(
            f"{name} [{', '.join(map(html.escape, ids))}]"
            for name, ids in (
                ("waiting", self.waiting),
                ("running", self.running),
                ("swapped", self.swapped),
            )
        )
        parts = [f"<b>engine after step {self.step}</b>: {queues}", self.pool._repr_html_()]
        parts += [r._repr_html_() for r in self.requests.values()]
        if self.finished:
            done = ", ".join(html.escape(r) for r in self.finished)
            parts.append(f"finished (last state kept): {done}")
        return "<br>".join(parts)


def _table(header, rows, title="") -> str:
    cells = lambda tag, row: "".join(f"<{tag}>{html.escape(str(v))}</{tag}>" for v in row)
    body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    return f"{title}<table><tr>{cells('th', header)}</tr>{body}</table>"


def _sequences_table(seqs: tuple[SequenceView, ...]) -> str:
    rows = []
    for s in seqs:
        refs = s.ref_counts or ("-",) * len(s.block_table)
        blocks = " ".join(
            f"#{b}:{t}" + (f"(r{r})" if r != 1 else "")
            for b, t, r in zip(s.block_table, s.tokens_per_block, refs, strict=True)
        )
        status = s.status + (f" ({s.finish_reason})" if s.finish_reason else "")
        rows.append(
            (s.seq_id, status, s.num_tokens, s.num_computed_tokens, s.location, blocks, s.text)
        )
    header = ["seq", "status", "tokens", "computed", "blocks on", "#block:tokens(refs)", "text"]
    return _table(header, rows)
