"""Admission: tokenize and validate a request, and decide once whether it can ever run.

Pure Python; imports no jax. ``LLMEngine.add_request``, ``LLM.generate`` and the HTTP server all
go through :meth:`InputProcessor.check`, so a request that the engine could never finish under its
configuration is refused with a ``ValueError`` naming the limit before anything is queued. The
arithmetic here is the scheduler's promise: every request it accepts reaches the front of the
queues with a pool, a token budget, a sequence limit and swap space that can hold it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np

from pagedjax.core.window import live_blocks, shared_window
from pagedjax.inputs import PromptType, split_prompt
from pagedjax.models.loading.tokenizer import encode_text
from pagedjax.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from pagedjax.structured_output.grammar import GrammarCompiler
from pagedjax.structured_output.masks import check_allowed_ids_meet
from pagedjax.utils import cdiv

Params = SamplingParams | BeamSearchParams


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The limits one request is checked against (the engine's, fixed at start)."""

    max_model_len: int
    max_num_seqs: int
    token_budget: int  # max_num_batched_tokens
    enable_chunked_prefill: bool
    block_size: int
    num_blocks: int  # the device pool, the null block included
    num_usable_blocks: int  # device blocks a request may hold at once (null and watermark out)
    num_host_blocks: int  # swap space, in blocks
    vocab_size: int
    sliding_window: int | None = None  # one window shared by every layer: blocks before it free
    max_logprobs: int = MAX_LOGPROBS  # logprobs / prompt_logprobs a request may ask for

    @classmethod
    def of(cls, config, num_blocks: int, watermark_blocks: int, num_host_blocks: int, model_config):
        sched = config.scheduler
        return cls(
            max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            token_budget=sched.token_budget,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            block_size=config.cache.block_size,
            num_blocks=num_blocks,
            num_usable_blocks=num_blocks - 1 - watermark_blocks,
            num_host_blocks=num_host_blocks,
            vocab_size=model_config.vocab_size,
            sliding_window=shared_window(model_config.layer_windows),
            max_logprobs=config.max_logprobs,
        )


def check_capacity(cap: Capacity) -> None:
    """Refuse configurations under which no request could ever run."""
    if not cap.enable_chunked_prefill and cap.token_budget < cap.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={cap.token_budget} is below max_model_len="
            f"{cap.max_model_len} with chunked prefill disabled: a long prompt (or a sequence "
            "recomputed after preemption) could never be scheduled; raise max_num_batched_tokens "
            "or enable chunked prefill"
        )
    if request_blocks(cap, 1, cap.max_model_len, 1) > cap.num_usable_blocks:
        raise ValueError(
            f"num_blocks={cap.num_blocks} ({cap.num_usable_blocks} usable, of block_size "
            f"{cap.block_size}) cannot hold one sequence of max_model_len={cap.max_model_len}; "
            "raise num_blocks or lower max_model_len"
        )


def peak_blocks(prompt_len: int, total_len: int, width: int, block_size: int) -> int:
    """Most device blocks a request of ``width`` sequences holds at once: the prompt's full blocks
    are shared, every sequence owns the rest of its table. A running sequence never has a slot
    for its final token (it finishes once that token is sampled), so it stops at total_len - 1."""
    shared = prompt_len // block_size
    own = cdiv(total_len - 1, block_size) - shared
    return shared + width * max(own, 0)


def request_blocks(cap: Capacity, prompt_len: int, total_len: int, width: int) -> int:
    """Most device blocks a request holds at once: peak_blocks, or with a shared sliding window
    (core/window.py) the live blocks around each sequence's window, if fewer: width decodes of
    one token, and a prefill of one chunk (the block manager shrinks chunks to fit the pool)
    or, without chunked prefill, of the longest prompt (a recompute: total_len - 1 tokens)."""
    need = peak_blocks(prompt_len, total_len, width, cap.block_size)
    if cap.sliding_window is None:
        return need
    w, bs = cap.sliding_window, cap.block_size
    chunk = 1 if cap.enable_chunked_prefill else total_len - 1
    return min(need, max(width * live_blocks(w, 1, bs), live_blocks(w, chunk, bs)))


def truncated(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: a prompt's last ``k`` token ids (-1: the last
    ``max_model_len``); all of them when ``k`` is None or the prompt is no longer."""
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


class InputProcessor:
    def __init__(self, capacity: Capacity, tokenizer=None):
        self.capacity = capacity
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, capacity.vocab_size)  # structured output

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt in any of vLLM's forms (pagedjax/inputs.py): a
        TokensPrompt's ids are taken as given, with its text if it has one."""
        text, ids = split_prompt(prompt)
        if ids is not None:
            return text, self._checked_ids(ids)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
        try:
            return text, encode_text(self.tokenizer, text)
        except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
            raise ValueError(f"the prompt cannot be tokenized: {e}") from e

    def _checked_ids(self, ids: list) -> list[int]:
        vocab = self.capacity.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def copy_params(self, params: Params) -> Params:
        """The request's own copy: changing the caller's object later changes nothing here."""
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise ValueError(f"expected SamplingParams or BeamSearchParams, got {params!r:.200}")
        try:
            return copy.deepcopy(params)
        except RecursionError:  # e.g. a schema nested deeper after its params were checked
            raise ValueError("the sampling parameters are nested too deeply to copy") from None

    def check(self, prompt_token_ids: list[int], params: Params) -> None:
        """Raise ValueError, naming the limit, if this request could never run to the end."""
        cap = self.capacity
        n = len(prompt_token_ids)
        if not n:
            raise ValueError("the prompt is empty")
        if n >= cap.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens and leaves no room to generate within "
                f"max_model_len={cap.max_model_len}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name, None)
            if k is not None and k > cap.max_logprobs:
                raise ValueError(f"{name}={k} exceeds max_logprobs={cap.max_logprobs}")
        if isinstance(params, SamplingParams):
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this model has none")
            bad = [t for t in params.stop_token_ids if t >= cap.vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids {bad} are outside the vocabulary [0, {cap.vocab_size})"
                )
            bad = sorted(t for t in params.logit_bias or () if t >= cap.vocab_size)
            if bad:
                raise ValueError(
                    f"logit_bias: token ids {bad[:8]} are outside the vocabulary "
                    f"[0, {cap.vocab_size})"
                )
            bad = sorted(t for t in params.allowed_token_ids or () if t >= cap.vocab_size)
            if bad:
                raise ValueError(
                    f"allowed_token_ids: token ids {bad[:8]} are outside the vocabulary "
                    f"[0, {cap.vocab_size})"
                )
            so = params.structured_outputs
            if so is not None:  # a bad schema, regex or grammar is named
                compiled = self.grammars.compile(so)
                if params.allowed_token_ids is not None:
                    check_allowed_ids_meet(compiled.first_mask(), params.allowed_token_ids, so.kind)
            width_name = "best_of" if (params.best_of or 0) > params.n else "n"
        else:
            width_name = "beam_width"
        width = params.max_num_seqs
        if width > cap.max_num_seqs:
            raise ValueError(
                f"{width_name}={width} exceeds max_num_seqs={cap.max_num_seqs}, the most sequences "
                "the engine runs at once"
            )
        if width > cap.token_budget:
            raise ValueError(
                f"{width_name}={width} exceeds max_num_batched_tokens={cap.token_budget}: its "
                "sequences could not all decode in one step"
            )
        total = min(n + params.max_tokens, cap.max_model_len)
        need = request_blocks(cap, n, total, width)
        if need > cap.num_usable_blocks:
            raise ValueError(
                f"the request may need {need} KV blocks at once ({width} sequence(s) of up to "
                f"{total} tokens, block_size={cap.block_size}), more than the pool's "
                f"{cap.num_usable_blocks}; lower max_tokens or {width_name}, or raise num_blocks"
            )
        if width > 1 and need > cap.num_host_blocks:
            raise ValueError(
                f"{width_name}={width}: a request of several sequences can only be preempted by "
                f"swapping, and it may hold {need} blocks, more than the {cap.num_host_blocks} "
                "blocks of swap space; raise swap_space_gib or lower max_tokens"
            )


def eos_token_ids(model_config, source: str, tokenizer) -> frozenset[int]:
    """The model config's EOS ids, generation_config.json's and the tokenizer's."""
    eos = set(model_config.eos_token_ids) | set(generation_config_eos_ids(source))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


def generation_config_eos_ids(source: str) -> tuple[int, ...]:
    """EOS ids that a checkpoint lists only in generation_config.json (as Llama-3 and Qwen2.5
    instruct models do); transformers stops on them, so the engine does too."""
    file = Path(source) / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(int(t) for t in ids if isinstance(t, int) and not isinstance(t, bool))
