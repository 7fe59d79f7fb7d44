"""vLLM's periodic stats line (on unless ``disable_log_stats``): every ``interval_s`` the engine's
generation throughput, its queues, its KV cache use and its prefix cache hit rate, at INFO."""

from __future__ import annotations

import logging
import threading
import time

from pagedjax.outputs import EngineStats

logger = logging.getLogger("pagedjax.engine.stats")
LOG_INTERVAL_S = 10.0  # vLLM's


class StatsLog:
    """Call ``tick(stats)`` as often as convenient; a line is logged when ``interval_s`` has
    passed since the last one (the first call only starts the clock)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last: tuple[float, int] | None = None  # (time, generation tokens) at the last line

    def due(self) -> bool:
        """Whether ``tick`` would log now (so that stats are read only then)."""
        return self._last is None or self._clock() - self._last[0] >= self.interval_s

    def tick(self, stats: EngineStats) -> str | None:
        """Log (and return) the line when one is due; None otherwise."""
        now = self._clock()
        if self._last is None:
            self._last = (now, stats.num_generation_tokens)
            return None
        then, tokens = self._last
        if now - then < self.interval_s:
            return None
        self._last = (now, stats.num_generation_tokens)
        line = format_stats(stats, (stats.num_generation_tokens - tokens) / (now - then))
        logger.info("%s", line)
        return line


def format_stats(s: EngineStats, generation_tokens_per_s: float) -> str:
    usage = s.num_blocks_used / max(s.num_blocks_total, 1)
    return (
        f"Avg generation throughput: {generation_tokens_per_s:.1f} tokens/s, "
        f"Running: {s.num_requests_running} reqs, Swapped: {s.num_requests_swapped} reqs, "
        f"Waiting: {s.num_requests_waiting} reqs, KV cache usage: {usage:.1%}, "
        f"Prefix cache hit rate: {s.prefix_cache_hit_rate:.1%}"
    )


def start_stats_log(read_stats, interval_s: float = LOG_INTERVAL_S) -> threading.Thread:
    """A daemon thread that logs the stats line every ``interval_s`` from ``read_stats()`` (the
    server's latest EngineStats snapshot, or None before the engine's first pass)."""
    log = StatsLog(interval_s)

    def run() -> None:
        while True:
            stats = read_stats()
            if stats is not None:
                log.tick(stats)
            time.sleep(interval_s / 2)

    thread = threading.Thread(target=run, name="pagedjax-stats-log", daemon=True)
    thread.start()
    return thread
