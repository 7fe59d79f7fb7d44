"""LLM: the offline API (vLLM's shape) over a paged KV pool.

This is the walking skeleton's generation loop: FCFS admission while blocks allow, prefill steps
and decode steps, a block appended on each boundary, preemption by recompute when the pool runs
dry. The block manager and scheduler replace its internals, not its public face.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from models.llama import kv_pool_bytes_per_block
from models.loader import default_model_path, load_model, load_tokenizer
from pagedjax.config import DEFAULT_CPU_KV_SPACE_GIB, CacheConfig, EngineConfig, SchedulerConfig
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.runner import Runner, ScheduledSeq
from pagedjax.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclasses.dataclass
class EngineStats:
    num_blocks_total: int  # allocatable blocks (the null block excluded)
    num_blocks_used: int
    num_blocks_peak: int
    kv_slots_allocated_peak: int
    kv_tokens_stored_peak: int
    kv_utilization: float  # tokens stored / slots allocated, summed over every step of the run
    num_preemptions: int
    num_swapped_out: int
    prefix_cache_hit_rate: float
    num_compilations: int


@dataclasses.dataclass
class _Seq:
    index: int
    prompt: str | None
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    seed: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the pool
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class LLM:
    """Offline batched generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_space_gib: float | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
    ):
        loaded = load_model(model or default_model_path(), dtype=dtype, cache_dir=cache_dir)
        self.model_config = mc = loaded.config
        limit = min(mc.max_position_embeddings, mc.sliding_window or mc.max_position_embeddings)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's limit of {limit} tokens"
            )
        cache = CacheConfig(block_size, num_blocks, kv_cache_space_gib)
        self.config = EngineConfig(
            model=loaded.source,
            dtype=dtype,
            seed=seed,
            cache=cache,
            scheduler=SchedulerConfig(max_num_seqs, max_model_len or limit, max_num_batched_tokens),
        )
        self.tokenizer = load_tokenizer(loaded)
        num_blocks = num_blocks or self._auto_num_blocks()
        max_len = self.config.scheduler.max_model_len
        if (num_blocks - 1) * block_size < max_len:
            raise ValueError(
                f"num_blocks={num_blocks} (x block_size {block_size}) cannot hold one sequence "
                f"of max_model_len={max_len}; raise num_blocks or lower max_model_len"
            )
        self.runner = Runner(
            mc, loaded.params, num_blocks=num_blocks, block_size=block_size, max_model_len=max_len
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._rng = np.random.default_rng(seed)
        self._free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self._stats = collections.Counter()

    def _auto_num_blocks(self) -> int:
        per_block = kv_pool_bytes_per_block(
            self.model_config, self.config.cache.block_size, self.config.dtype
        )
        space = self.config.cache.kv_cache_space_gib
        if space is None:
            device = jax.devices()[0]
            mem = device.memory_stats() if device.platform != "cpu" else None
            if mem and "bytes_limit" in mem:
                space_bytes = 0.9 * (mem["bytes_limit"] - mem.get("bytes_in_use", 0))
            else:
                space_bytes = DEFAULT_CPU_KV_SPACE_GIB * 2**30
        else:
            space_bytes = space * 2**30
        return int(space_bytes // per_block)

    # ---- requests -------------------------------------------------------------------------

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            return prompt, self.tokenizer(prompt)["input_ids"]
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return None, [int(t) for t in ids]

    def _make_seqs(self, prompts, sampling_params) -> list[_Seq]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int | np.integer)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts"
            )
        max_len = self.config.scheduler.max_model_len
        seqs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            text, ids = self._tokenize(prompt)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= max_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; max_model_len={max_len} leaves no room "
                    "to generate"
                )
            seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
            seqs.append(_Seq(i, text, len(ids), ids, params, seed))
        return seqs

    def chat(self, messages, sampling_params: SamplingParams | None = None, **kwargs):
        """Apply the tokenizer's chat template to one conversation (or a list of them)."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in convs
        ]
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.generate(ids, sampling_params, **kwargs)

    # ---- the loop -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        seqs = self._make_seqs(prompts, sampling_params)
        waiting = collections.deque(seqs)
        running: list[_Seq] = []
        bar = tqdm(total=len(seqs), disable=not use_tqdm, desc="generating")
        while waiting or running:
            prefill = self._admit(waiting, running)
            batch = prefill or self._reserve_decode_slots(running, waiting)
            if not batch:
                raise RuntimeError("no sequence can be scheduled (the pool is too small)")
            self._run(batch)
            self._record_usage(running)
            for s in [s for s in running if s.finish_reason]:
                running.remove(s)
                self._free(s)
                bar.update(1)
        bar.close()
        return [self._output(s) for s in seqs]

    def _admit(self, waiting: collections.deque, running: list[_Seq]) -> list[_Seq]:
        """FCFS: move waiting sequences to running while blocks and the token budget allow."""
        admitted, budget = [], self.config.scheduler.token_budget
        bs = self.config.cache.block_size
        while waiting and len(running) < self.config.scheduler.max_num_seqs:
            s = waiting[0]
            need = -(-len(s.tokens) // bs)
            if len(s.tokens) > budget or need > len(self._free_blocks):
                break
            waiting.popleft()
            s.blocks = [self._free_blocks.pop() for _ in range(need)]
            budget -= len(s.tokens)
            admitted.append(s)
            running.append(s)
        running.sort(key=lambda s: s.index)
        return admitted

    def _reserve_decode_slots(self, running: list[_Seq], waiting: collections.deque):
        """Give every running sequence a slot for its next token, preempting the latest-arrived
        sequences (by recompute) while the pool is dry."""
        bs = self.config.cache.block_size
        for s in list(running):
            if s not in running:
                continue  # preempted below
            while s.num_computed // bs >= len(s.blocks):
                if self._free_blocks:
                    s.blocks.append(self._free_blocks.pop())
                    continue
                victim = running.pop()
                self._free(victim)
                victim.num_computed = 0
                waiting.appendleft(victim)
                self._stats["num_preemptions"] += 1
                if victim is s:
                    break
        return list(running)

    def _run(self, batch: list[_Seq]) -> None:
        sched = []
        for s in batch:
            p = s.params
            sched.append(
                ScheduledSeq(
                    token_ids=s.tokens[s.num_computed :],
                    start_pos=s.num_computed,
                    block_table=s.blocks,
                    sampling=(
                        float(p.temperature),
                        max(p.top_k, 0),
                        float(p.top_p),
                        float(p.min_p),
                        s.seed,
                    ),
                )
            )
        tokens, logprobs = self.runner.execute(sched)
        max_len = self.config.scheduler.max_model_len
        for s, t, lp in zip(batch, tokens.tolist(), logprobs.tolist(), strict=True):
            s.num_computed = len(s.tokens)
            s.tokens.append(t)
            s.cumulative_logprob += lp
            p = s.params
            if (not p.ignore_eos and t in self.eos_token_ids) or t in p.stop_token_ids:
                s.finish_reason = "stop"
            elif len(s.output_ids) >= p.max_tokens or len(s.tokens) >= max_len:
                s.finish_reason = "length"

    def _free(self, s: _Seq) -> None:
        self._free_blocks.extend(reversed(s.blocks))
        s.blocks = []

    def _record_usage(self, holding: list[_Seq]) -> None:
        num_total = self.runner.num_blocks - 1
        used = num_total - len(self._free_blocks)
        slots = used * self.config.cache.block_size
        stored = sum(s.num_computed for s in holding)
        st = self._stats
        st["num_blocks_peak"] = max(st["num_blocks_peak"], used)
        st["kv_slots_allocated_peak"] = max(st["kv_slots_allocated_peak"], slots)
        st["kv_tokens_stored_peak"] = max(st["kv_tokens_stored_peak"], stored)
        st["slots_sum"] += slots
        st["stored_sum"] += stored

    def _output(self, s: _Seq) -> RequestOutput:
        text = (
            self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
            if self.tokenizer is not None
            else ""
        )
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=s.output_ids,
            cumulative_logprob=s.cumulative_logprob,
            logprobs=None,
            finish_reason=s.finish_reason,
        )
        return RequestOutput(
            str(s.index),
            s.prompt,
            s.tokens[: s.prompt_len],
            [completion],
            finished=s.finish_reason is not None,
        )

    # ---- inspection -----------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        st = self._stats
        total = self.runner.num_blocks - 1
        return EngineStats(
            num_blocks_total=total,
            num_blocks_used=total - len(self._free_blocks),
            num_blocks_peak=st["num_blocks_peak"],
            kv_slots_allocated_peak=st["kv_slots_allocated_peak"],
            kv_tokens_stored_peak=st["kv_tokens_stored_peak"],
            kv_utilization=st["stored_sum"] / st["slots_sum"] if st["slots_sum"] else 0.0,
            num_preemptions=st["num_preemptions"],
            num_swapped_out=0,
            prefix_cache_hit_rate=0.0,
            num_compilations=self.runner.num_compilations,
        )

    def close(self) -> None:
        """Free the device KV pool and parameters; the LLM is unusable afterwards."""
        self.runner.free_device_memory()
        for leaf in jax.tree.leaves(self.runner.params):
            leaf.delete()
        self.runner.params = None
