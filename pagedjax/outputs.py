"""What the engine returns: RequestOutput (shaped like vLLM's) and EngineStats."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pagedjax.spec_decode.metrics import SpecDecodingStats


@dataclasses.dataclass
class Logprob:
    """A token's log-probability, its rank among the vocabulary (1 = most likely) and its text
    (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def token_texts(tokenizer) -> Callable[[int], str | None]:
    """A token's text decoded alone, special tokens kept (a Logprob's decoded_token), cached per
    token; None without a tokenizer. Decoding only: threads may share the tokenizer."""
    cache: dict[int, str | None] = {}

    def text(token: int) -> str | None:
        if token not in cache:
            decoded = (
                None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)
            )
            cache[token] = decoded
        return cache[token]

    return text


def sample_logprobs_entry(
    entry: dict[int, float], k: int, token_text: Callable[[int], str | None]
) -> dict[int, Logprob]:
    """One generated token's logprobs as vLLM gives them: the sampled token first, then the k
    most likely, each a Logprob with its rank (1 = most likely) and text. ``entry`` is the
    engine's (sampled token first, then the top k; a top token that was sampled is listed
    once). A sampled token outside the top k has rank None: only its lower bound, k + 1, is
    known."""
    values = list(entry.values())
    out = {}
    for i, (token, logprob) in enumerate(entry.items()):
        outside_top = i == 0 and len(entry) > k
        rank = None if outside_top else 1 + sum(v > logprob for v in values)
        out[token] = Logprob(logprob, rank, token_text(token))
    return out


class PromptLogprobsList(Sequence):
    """RequestOutput.prompt_logprobs as vLLM shapes it (None for the first prompt token, then
    per token a dict token id -> Logprob: its own and the k most likely, rank 1 = most likely),
    kept as the arrays the engine scored and built into that list when first read. A pickle of
    it is those arrays (kilobytes, where the built list is thousands of objects): the engine
    process sends it that way and the API process names the tokens' text with ``bind``."""

    def __init__(self, prompt, logprobs, ranks, top_ids, top_logprobs, token_text=None):
        self.prompt = list(prompt)  # token ids
        self.arrays = (logprobs, ranks, top_ids, top_logprobs)  # [n], [n], [n, k], [n, k]
        self._token_text: Callable[[int], str | None] | None = token_text
        self._entries: list | None = None

    def bind(self, token_text: Callable[[int], str | None]) -> None:
        """Name each token's text with ``token_text`` (a Logprob's decoded_token)."""
        self._token_text, self._entries = token_text, None

    def _built(self) -> list[dict[int, Logprob] | None]:
        if self._entries is None:
            text = self._token_text or (lambda token: None)
            logprobs, ranks, top_ids, top_logprobs = self.arrays
            out: list[dict[int, Logprob] | None] = [None]
            for j in range(1, len(self.prompt)):
                token = self.prompt[j]
                entry = {token: Logprob(float(logprobs[j]), int(ranks[j]), text(token))}
                ids, lps = top_ids[j].tolist(), top_logprobs[j].tolist()
                for rank, (t, lp) in enumerate(zip(ids, lps, strict=True), 1):
                    entry.setdefault(t, Logprob(lp, rank, text(t)))
                out.append(entry)
            self._entries = out
        return self._entries

    def __getitem__(self, index):
        return self._built()[index]

    def __len__(self) -> int:
        return len(self.prompt)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._built())

    def __getstate__(self) -> dict:
        return {"prompt": self.prompt, "arrays": self.arrays, "_token_text": None, "_entries": None}


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # SamplingParams(logprobs=k): per generated token, the sampled token's Logprob and the k
    # most likely's (sample_logprobs_entry)
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" (EOS / stop token), "length", "abort", or None (running)
    # vLLM's: the stop token id or stop string that ended it with "stop" (None for EOS), or why
    # a grammar ended it with "abort" (no token of the vocabulary could continue it).
    stop_reason: int | str | None = None


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """When the engine took a request, first scheduled it and got its first output token
    (``time.monotonic`` seconds, this process's clock; vLLM's names); a server measures time to
    first token, queue and prefill time from these, also for a request that asked for its final
    output alone."""

    arrival_time: float
    first_token_time: float | None = None
    first_scheduled_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Set when the engine ended the request itself (it could not run it, or it failed on its
    # own): its completions then finish with "abort" and keep what was generated so far.
    error: str | None = None
    # SamplingParams(prompt_logprobs=k): one entry per prompt token, None for the first; each the
    # token's own Logprob and the k most likely. Set once the whole prompt is scored.
    prompt_logprobs: PromptLogprobsList | None = None
    # Its proposals, accepted tokens, acceptance rate and mean acceptance length, when the engine
    # speculates (speculative_config); None otherwise.
    spec_decoding: SpecDecodingStats | None = None
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam as vLLM's ``LLM.beam_search`` returns it: its tokens and text include the
    prompt's. ``logprobs`` stays empty: the engine ranks beams by cumulative logprob and keeps
    no per-token entries for them."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput(RequestOutput):
    """``LLM.beam_search``'s result: vLLM's ``sequences`` (best first), and the RequestOutput
    fields too (``outputs`` holds the same beams without the prompt)."""

    sequences: list[BeamSearchSequence] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, out: RequestOutput, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """``out``'s beams as sequences, each text ``decode(prompt + beam tokens)``."""
        fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(RequestOutput)}
        sequences = []
        for c in out.outputs:
            tokens = list(out.prompt_token_ids) + list(c.token_ids)
            cum = c.cumulative_logprob or 0.0
            seq = BeamSearchSequence(tokens, [], cum, decode(tokens), c.finish_reason)
            seq.stop_reason = c.stop_reason
            sequences.append(seq)
        return cls(**fields, sequences=sequences)


@dataclasses.dataclass
class EngineStats:
    num_blocks_total: int  # allocatable blocks (the null block excluded)
    num_blocks_used: int
    num_blocks_peak: int
    kv_slots_allocated_peak: int
    kv_tokens_stored_peak: int
    kv_utilization: float  # tokens stored / slots allocated, summed over every step of the run
    num_preemptions: int
    num_swapped_out: int  # blocks moved device -> host
    prefix_cache_hit_rate: float
    num_compilations: int
    # The KV pool's page dtype ("float32", "bfloat16", "int8", "float8_e4m3fn"): with
    # num_blocks_total, what kv_cache_dtype bought
    kv_cache_dtype: str = ""
    num_swapped_in: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_aborted: int = 0  # requests the engine ended itself, each with a reason (never a client's)
    compile_seconds: float = 0.0  # spent compiling (or loading) the num_compilations programs
    num_requests_waiting: int = 0  # queued, or preempted for recompute
    num_requests_running: int = 0
    num_requests_swapped: int = 0
    # Padded token rows (and attention work) computed per real one, over every step so far.
    token_padding_ratio: float = 1.0
    attention_padding_ratio: float = 1.0
    spec_decoding: SpecDecodingStats | None = None  # all requests' counts, when it speculates
    num_overlapped_steps: int = 0  # dispatched while the step before ran (async scheduling)
    num_generation_tokens: int = 0  # output tokens generated, every request's, since the start
    # With the step profile's timing on (engine.profile.enabled): per step kind ("prefill",
    # "mixed", "decode") its steps, host_ms and device_ms per step, bytes_per_step (weights once +
    # the KV pages read) and mbu (bytes / device time / copy bandwidth); mbu over every step, and
    # the copy bandwidth measured when timing was switched on. Empty / None while it is off.
    step_kinds: dict = dataclasses.field(default_factory=dict)
    mbu: float | None = None
    copy_gbps: float | None = None

    @classmethod
    def of(cls, bm, scheduler, runner, profile, num_overlapped_steps: int = 0) -> EngineStats:
        """From the block manager's stats, the scheduler's and the runner's counters and the
        step profile's padding counts."""
        return cls(
            num_blocks_total=bm.num_blocks_total,
            num_blocks_used=bm.num_blocks_used,
            num_blocks_peak=bm.num_blocks_peak,
            kv_slots_allocated_peak=bm.kv_slots_allocated_peak,
            kv_tokens_stored_peak=bm.kv_tokens_stored_peak,
            kv_utilization=bm.kv_utilization,
            num_preemptions=scheduler.num_preemptions,
            num_swapped_out=bm.num_swapped_out,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_compilations=runner.num_compilations,
            kv_cache_dtype=_pool_dtype(runner),
            num_swapped_in=bm.num_swapped_in,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_aborted=scheduler.num_aborted,
            compile_seconds=runner.compile_seconds,
            num_requests_waiting=len(scheduler.waiting),
            num_requests_running=len(scheduler.running),
            num_requests_swapped=len(scheduler.swapped),
            token_padding_ratio=profile.token_padding_ratio,
            attention_padding_ratio=profile.attention_padding_ratio,
            spec_decoding=spec.stats.copy() if (spec := scheduler.speculator) else None,
            num_overlapped_steps=num_overlapped_steps,
            num_generation_tokens=scheduler.num_generation_tokens,
            step_kinds=profile.per_kind() if profile.copy_bytes_per_s else {},
            mbu=profile.mbu(),
            copy_gbps=profile.copy_bytes_per_s / 1e9 if profile.copy_bytes_per_s else None,
        )


def _pool_dtype(runner) -> str:
    """The name of the runner's KV pool dtype ("" for a runner without a device pool: the
    tests' fake model)."""
    return str(runner.kv_cache.dtype) if runner.kv_cache is not None else ""
