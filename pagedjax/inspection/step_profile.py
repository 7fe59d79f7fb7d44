"""Where a step's time goes, and how much of its work is padding.

Padding counts are always kept (they are cheap): per step kind (prefill, mixed, decode), real vs
padded token rows, and real vs padded attention work (query rows x keys the attention path
computes). Phase timing is on only while ``enabled``: then the runner waits for the device at the
end of each phase, so the split is exact but the host and the device no longer overlap (a
profiled run is slower than a plain one; its total is not a throughput figure).

Phases: ``schedule`` (scheduler, block moves), ``build`` (StepInput and sampling inputs, host),
``device`` (the model step and sampler until their results are ready), ``fetch`` (sampler output
to the host), ``update`` (append tokens, fork, stop), ``output`` (detokenize, stop strings,
RequestOutputs).

Memory-bandwidth utilization (MBU), per step kind: the bytes a step must read (the weights once,
plus the KV pages its attention reads, counted as the GPU kernels work: whole pages up to each
sequence's context) over the step's device time, over a copy bandwidth measured once when timing
is first switched on (a device copy; on a CPU the same copy in host memory). Host time per kind is
the step's host phases: schedule and build before its ``count``, fetch, update and output after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

PHASES = ("schedule", "build", "device", "fetch", "update", "output")


@dataclasses.dataclass
class KindCounts:
    steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    real_attention: int = 0  # sum over sequences of query rows x context keys
    padded_attention: int = 0  # what the attention path computes for the padded shape
    device_seconds: float = 0.0  # with timing on
    host_seconds: float = 0.0  # with timing on: the step's host phases
    bytes_read: int = 0  # weights once per step + the KV pages its attention reads


PRE_STEP_PHASES = ("schedule", "build")  # host phases before a step's count; the rest after


class StepProfile:
    def __init__(self):
        self._enabled = False
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.kinds: dict[str, KindCounts] = {}
        self.wall_seconds = 0.0  # steps' wall time while enabled
        self._pending_host = 0.0  # host phases of a step not yet counted
        self._last_kind: str | None = None
        # The model's bytes (set_model_bytes) and the copy bandwidth outlive reset().
        if not hasattr(self, "weight_bytes"):
            self.weight_bytes = 0
            self.kv_page_bytes = 0  # one block of K and V in every layer
            self.copy_bytes_per_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Switch phase timing; the first switch on measures the copy bandwidth MBU divides by."""
        if on and self.copy_bytes_per_s is None:
            self.copy_bytes_per_s = measure_copy_bandwidth()
        self._enabled = bool(on)

    def set_model_bytes(self, weight_bytes: int, kv_page_bytes: int) -> None:
        """What a step reads: ``weight_bytes`` once, ``kv_page_bytes`` per KV page read."""
        self.weight_bytes, self.kv_page_bytes = int(weight_bytes), int(kv_page_bytes)

    def step_bytes(self, kv_pages: int) -> int:
        """Bytes one step must read from memory: the weights once and ``kv_pages`` pages."""
        return self.weight_bytes + kv_pages * self.kv_page_bytes

    @contextlib.contextmanager
    def phase(self, name: str, kind: str | None = None):
        """Time the block as phase ``name``; with a step ``kind`` (as ``count`` named it: the
        runner passes one for its device phases) the time is also that kind's device time; a
        host phase's time goes to the kind of its step."""
        if not self._enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[name] += elapsed
            if kind is not None:
                self.kinds.setdefault(kind, KindCounts()).device_seconds += elapsed
            elif name in PRE_STEP_PHASES:
                self._pending_host += elapsed
            elif self._last_kind is not None:
                self.kinds[self._last_kind].host_seconds += elapsed

    def count(
        self, kind: str, real_tokens: int, padded_tokens: int, real_attn, padded_attn, kv_pages=0
    ):
        """One step of ``kind``; ``kv_pages``: the KV pages its attention reads (every
        sequence's pages up to its context)."""
        k = self.kinds.setdefault(kind, KindCounts())
        k.steps += 1
        k.real_tokens += real_tokens
        k.padded_tokens += padded_tokens
        k.real_attention += real_attn
        k.padded_attention += padded_attn
        k.bytes_read += self.step_bytes(kv_pages)
        k.host_seconds += self._pending_host
        self._pending_host, self._last_kind = 0.0, kind

    @property
    def token_padding_ratio(self) -> float:
        """Padded token rows computed per real one, over every step (1.0: no padding)."""
        real = sum(k.real_tokens for k in self.kinds.values())
        return sum(k.padded_tokens for k in self.kinds.values()) / real if real else 1.0

    @property
    def attention_padding_ratio(self) -> float:
        real = sum(k.real_attention for k in self.kinds.values())
        return sum(k.padded_attention for k in self.kinds.values()) / real if real else 1.0

    def mbu(self, kind: str | None = None) -> float | None:
        """Bytes read / device time / copy bandwidth, for one step kind or every step; None
        without timed steps, model bytes or a measured bandwidth."""
        kinds = list(self.kinds.values()) if kind is None else [self.kinds.get(kind, KindCounts())]
        seconds = sum(k.device_seconds for k in kinds)
        if not seconds or not self.copy_bytes_per_s or not self.weight_bytes:
            return None
        return sum(k.bytes_read for k in kinds) / seconds / self.copy_bytes_per_s

    def per_kind(self) -> dict[str, dict]:
        """Per step kind: steps, host and device ms per step, bytes per step, MBU."""
        out = {}
        for name, k in self.kinds.items():
            n = max(k.steps, 1)
            out[name] = {
                "steps": k.steps,
                "host_ms": 1e3 * k.host_seconds / n,
                "device_ms": 1e3 * k.device_seconds / n,
                "bytes_per_step": k.bytes_read / n,
                "mbu": self.mbu(name),
            }
        return out

    def reset(self) -> None:
        self.__init__()

    def report(self) -> dict:
        timed = sum(self.seconds.values())
        return {
            "phases_s": dict(self.seconds),
            "phases_share": {k: v / timed for k, v in self.seconds.items()} if timed else {},
            "kinds": {k: dataclasses.asdict(v) for k, v in self.kinds.items()},
            "per_kind": self.per_kind(),
            "mbu": self.mbu(),
            "copy_gbps": self.copy_bytes_per_s / 1e9 if self.copy_bytes_per_s else None,
            "weight_bytes": self.weight_bytes,
            "kv_page_bytes": self.kv_page_bytes,
            "token_padding_ratio": self.token_padding_ratio,
            "attention_padding_ratio": self.attention_padding_ratio,
        }


def measure_copy_bandwidth(nbytes: int | None = None, repeats: int = 5, iters: int = 4) -> float:
    """Bytes per second of a streaming copy (one read and one write per byte) on the default
    device, best of ``repeats`` runs of ``iters`` copies back to back (launch cost amortized):
    256 MiB on an accelerator, 16 MiB in a CPU's memory."""
    import jax
    import jax.numpy as jnp

    if nbytes is None:
        nbytes = (16 << 20) if jax.default_backend() == "cpu" else (256 << 20)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + jnp.ones((), x.dtype))
    jax.block_until_ready(copy(x))  # compiled, and the pages touched
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [copy(x) for _ in range(iters)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - start) / iters)
    return 2 * x.nbytes / best


def model_read_bytes(runner) -> tuple[int, int]:
    """(weight bytes a step reads once, bytes of one KV page in every layer) of a runner's model:
    every weight but an untied input embedding (a step gathers only its rows); (0, 0) for a
    runner without device weights (the tests' fake model)."""
    import jax

    from pagedjax.models.llama import kv_pool_bytes_per_block

    params, kv_cache = runner.params, runner.kv_cache
    if params is None or kv_cache is None:
        return 0, 0
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    if not runner.config.tie_word_embeddings and "embed_tokens" in params:
        weights -= sum(x.nbytes for x in jax.tree.leaves(params["embed_tokens"]))
    page = kv_pool_bytes_per_block(runner.config, kv_cache.block_size, kv_cache.dtype)
    return weights, page
