"""Block-table rows that live across steps (vLLM V1's persistent input batch, for the tables).

A sequence keeps one row of a preallocated i32[rows, max_blocks_per_seq] buffer while it runs
(keyed by ``ScheduledSeq.seq_id``). Each step compares the table the scheduler hands over with the
one the row holds (a list comparison, no numpy call) and writes only what changed: nothing in most
decode steps, the new entries when a block was added, the whole row when an entry was replaced
(copy-on-write, a sliding window's dropped blocks, a preemption). The step's tables are then one
gather of its rows, in the step's order, so the ``StepInput`` is the one the stateless
``InputBatcher.build`` gives, entry for entry.

Rows of sequences missing from a step stay (they may come back next step) until a new sequence
finds no free row; then every row the step does not use is freed and reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PersistentBatch:
    """Block-table rows for up to ``max_rows`` sequences (see the module doc)."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.tables = np.zeros((max_rows, max_blocks_per_seq), np.int32)
        self._held: list[list[int]] = [[] for _ in range(max_rows)]  # the table each row holds
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._free = list(range(max_rows - 1, -1, -1))  # pop() takes the lowest row
        self.entries_written = 0  # table entries written to the buffer (tests read it)

    def rows_for(self, seq_ids: Sequence[int], tables: Sequence[list[int]]) -> np.ndarray:
        """i64[n]: the row holding each sequence's table, ``tables[i]`` written where it
        differs from what row i held. ``seq_ids`` must be distinct (one step's sequences)."""
        if len(seq_ids) > self.max_rows:
            raise ValueError(f"a step of {len(seq_ids)} sequences exceeds {self.max_rows} rows")
        row_of, held = self._row_of, self._held
        rows = []
        for key, table in zip(seq_ids, tables, strict=True):
            row = row_of.get(key)
            if row is None:
                row = self._take(key, seq_ids)
            if held[row] != table:
                self._write(row, table)
            rows.append(row)
        return np.asarray(rows, np.int64)

    def release(self, seq_id: int) -> None:
        """Free a sequence's row (a no-op when it holds none)."""
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    @property
    def num_held(self) -> int:
        return len(self._row_of)

    def _take(self, key: int, step_ids: Sequence[int]) -> int:
        if not self._free:  # free every row this step does not use
            used = set(step_ids)
            for other in [k for k in self._row_of if k not in used]:
                self.release(other)
        row = self._free.pop()
        self._row_of[key] = row
        return row

    def _write(self, row: int, table: list[int]) -> None:
        old, n, m = self._held[row], len(table), len(self._held[row])
        start = m if m < n and table[:m] == old else 0  # blocks appended: write only those
        self.tables[row, start:n] = table[start:]
        if m > n:
            self.tables[row, n:m] = 0  # the null block, as the stateless build pads
        self.entries_written += n - start
        self._held[row] = list(table)
