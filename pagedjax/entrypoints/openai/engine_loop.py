"""The engine thread: it applies queued commands (add, abort), runs ``engine.step()`` and hands
each RequestOutput to the sink of the HTTP request waiting for it. Handlers never touch the
engine's state; they talk to it through ``submit`` and ``abort``.

A request that fails inside the engine comes back as its own finished output with ``error`` set;
if ``step()`` itself raises, every request in flight gets the exception and the thread goes on
serving. Nothing a request does ends the thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time

from pagedjax.outputs import RequestOutput

logger = logging.getLogger("pagedjax.api_server")

# Multi-process: how often an idle driver pings its followers, which wait for it in a collective
# (a backend may time out a wait of hours).
_KEEP_ALIVE_S = 10.0


class QueueFull(Exception):
    pass


# ---- metrics --------------------------------------------------------------------------------


class _Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for b, c in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{self.name}_bucket{{le="{b}"}} {c}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Metrics:
    """Counters kept by the engine thread; gauges are a snapshot it refreshes every loop."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_errors = 0  # requests the engine finished with an error
        self.step_failures = 0  # steps that raised (every request in flight failed)
        self.requests_finished: dict[str, int] = {}
        self.ttft = _Histogram(
            "pagedjax_time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.tpot = _Histogram(
            "pagedjax_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _TPOT_BUCKETS,
        )
        self.gauges: dict[str, float] = {}


# ---- the thread -----------------------------------------------------------------------------


class _Tracked:
    """What the engine thread remembers about one engine request."""

    def __init__(self, sink, arrival: float):
        self.sink = sink  # callable(item) that passes item to the event loop thread
        self.arrival = arrival
        self.first_token: float | None = None
        self.num_tokens = 0


class EngineLoop:
    """Owns the engine on one thread; everything else reaches it through ``submit``/``abort``."""

    def __init__(self, engine, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = _Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._publish()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request_id: str, prompt_ids: list[int], params, sink):
        """Queue an add; the returned future fails with ValueError (bad request), QueueFull, or
        whatever else add_request raised."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", request_id, prompt_ids, params, sink, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- on the engine thread --

    def _run(self) -> None:
        last_step = time.monotonic()
        while not self._stop:
            try:
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stop:
                    break
                if time.monotonic() - last_step > _KEEP_ALIVE_S:
                    self.engine.keep_alive()
                    last_step = time.monotonic()
                if self.engine.has_unfinished_requests():
                    last_step = time.monotonic()
                    self._deliver(self.engine.step())
                self._publish()
            except Exception as e:  # keep serving: fail the requests in flight
                logger.exception("engine step failed")
                with self.metrics.lock:
                    self.metrics.step_failures += 1
                self._fail_all(e)
        self._fail_all(RuntimeError("the server is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is not None:
                self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd) -> None:
        if cmd[0] == "abort":
            if self._tracked.pop(cmd[1], None) is not None:
                self.engine.abort_request(cmd[1])
                self._count_finished("abort")
            return
        _, request_id, prompt_ids, params, sink, fut = cmd
        if not fut.set_running_or_notify_cancel():
            return
        if self.engine.get_stats().num_requests_waiting >= self.max_queue:
            fut.set_exception(QueueFull(f"{self.max_queue} requests are already waiting"))
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except Exception as e:  # add_request leaves the engine untouched when it raises
            fut.set_exception(e)
            return
        self._tracked[request_id] = _Tracked(sink, time.monotonic())
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(prompt_ids)
        fut.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        m = self.metrics
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            num = sum(len(c.token_ids) for c in out.outputs)
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            with m.lock:
                m.generation_tokens += num - t.num_tokens
                if t.first_token is None and num:
                    t.first_token = now
                    m.ttft.observe(now - t.arrival)
                if out.finished:
                    if longest > 1:
                        m.tpot.observe((now - t.first_token) / (longest - 1))
                    for c in out.outputs:
                        reason = c.finish_reason or "abort"
                        m.requests_finished[reason] = m.requests_finished.get(reason, 0) + 1
                    if out.error is not None:
                        m.request_errors += 1
            t.num_tokens = num
            if out.finished:
                del self._tracked[out.request_id]
            self._send(out.request_id, t, out)

    @staticmethod
    def _send(request_id: str, t: _Tracked, item) -> None:
        try:
            t.sink(item)
        except Exception:  # the event loop is gone (shutdown): nobody is waiting
            logger.warning("could not deliver the output of %s", request_id)

    def _count_finished(self, reason: str) -> None:
        with self.metrics.lock:
            fin = self.metrics.requests_finished
            fin[reason] = fin.get(reason, 0) + 1

    def _fail_all(self, error: Exception) -> None:
        for request_id, t in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            self._send(request_id, t, error)
        self._tracked.clear()
        try:
            self._publish()
        except Exception:
            logger.exception("could not read the engine's stats")

    def _publish(self) -> None:
        st = self.engine.get_stats()
        gauges = {
            "num_requests_running": st.num_requests_running,
            "num_requests_waiting": st.num_requests_waiting,
            "num_requests_swapped": st.num_requests_swapped,
            "kv_blocks_total": st.num_blocks_total,
            "kv_blocks_used": st.num_blocks_used,
            "kv_blocks_usage_ratio": st.num_blocks_used / max(st.num_blocks_total, 1),
            "prefix_cache_hit_rate": st.prefix_cache_hit_rate,
            "num_preemptions": st.num_preemptions,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
            "num_compilations": st.num_compilations,
            "compile_seconds": st.compile_seconds,
            "num_aborted": st.num_aborted,
        }
        with self.metrics.lock:
            self.metrics.gauges = gauges

    def render_metrics(self) -> str:
        m = self.metrics
        with m.lock:
            g = dict(m.gauges)
            lines: list[str] = []

            def metric(name, kind, help_, value, labels=""):
                lines.extend(
                    [
                        f"# HELP pagedjax_{name} {help_}",
                        f"# TYPE pagedjax_{name} {kind}",
                        f"pagedjax_{name}{labels} {value}",
                    ]
                )

            metric("num_requests_running", "gauge", "Requests running.", g["num_requests_running"])
            metric("num_requests_waiting", "gauge", "Requests waiting.", g["num_requests_waiting"])
            metric("num_requests_swapped", "gauge", "Requests swapped.", g["num_requests_swapped"])
            metric("kv_blocks_total", "gauge", "Allocatable KV blocks.", g["kv_blocks_total"])
            metric("kv_blocks_used", "gauge", "KV blocks in use.", g["kv_blocks_used"])
            metric("kv_cache_usage_ratio", "gauge", "Used / total.", g["kv_blocks_usage_ratio"])
            metric("prefix_cache_hit_rate", "gauge", "Prefix hits.", g["prefix_cache_hit_rate"])
            metric("num_preemptions_total", "counter", "Preemptions.", g["num_preemptions"])
            metric(
                "prefix_cache_queries_total",
                "counter",
                "Prefix lookups.",
                g["prefix_cache_queries"],
            )
            metric("prefix_cache_hits_total", "counter", "Prefix hits.", g["prefix_cache_hits"])
            metric("compilations_total", "counter", "Programs compiled.", g["num_compilations"])
            metric("compile_seconds_total", "counter", "Seconds compiling.", g["compile_seconds"])
            metric(
                "engine_aborts_total",
                "counter",
                "Requests the engine ended itself, with a reason.",
                g["num_aborted"],
            )
            metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", m.prompt_tokens)
            metric("generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens)
            metric(
                "request_errors_total",
                "counter",
                "Requests the engine finished with an error.",
                m.request_errors,
            )
            metric(
                "step_failures_total",
                "counter",
                "Engine steps that raised (every request in flight failed).",
                m.step_failures,
            )
            lines += [
                "# HELP pagedjax_request_success_total Finished sequences by finish reason.",
                "# TYPE pagedjax_request_success_total counter",
            ]
            for reason, count in sorted(m.requests_finished.items()):
                lines.append(
                    f'pagedjax_request_success_total{{finished_reason="{reason}"}} {count}'
                )
            lines += m.ttft.render() + m.tpot.render()
        return "\n".join(lines) + "\n"
