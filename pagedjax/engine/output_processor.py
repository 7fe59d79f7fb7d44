"""From tokens to what users read: incremental detokenization, stop strings, RequestOutput.

Pure Python; imports no jax. The scheduler stops sequences on EOS, stop token ids and length
(``scheduler.check_stop``); stop strings need the text, so they are checked here after
detokenizing, and a hit finishes the sequence through the scheduler.
"""

from __future__ import annotations

from collections.abc import Collection

from pagedjax.core import beam_search
from pagedjax.core.sequence import Sequence
from pagedjax.engine.request import Request, advance_grammars
from pagedjax.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobsList,
    RequestOutput,
    sample_logprobs_entry,
    token_texts,
)
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


def find_stop_string(text: str, searched: int, stops: list[str]) -> int:
    """Start of the earliest stop string in text, or -1. text[:searched] held none, so a new
    match ends after it: each stop is looked for in the tail where it could start."""
    first = -1
    for s in stops:
        i = text.find(s, max(0, searched - len(s) + 1))
        if i >= 0 and (first < 0 or i < first):
            first = i
    return first


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Collection[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # decode_batch of the tokenizer's backend, where it gives decode's text (chosen once)
        self._batch = None if tokenizer is None else _batch_decoder(tokenizer)
        self.token_text = token_texts(tokenizer)  # a Logprob's decoded_token, cached per token

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenize(self, seq: Sequence, skip_special_tokens: bool, keep_stop=False) -> None:
        """Incremental detokenisation (vLLM's): decode a short window, keep only complete text.
        The EOS or stop token id that finished seq adds no text unless ``keep_stop`` (vLLM's
        include_stop_str_in_output)."""
        if self.tokenizer is None:
            return
        ids = _text_ids(seq, keep_stop)
        prefix = self.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens)
        full = self.decode(ids[seq.prefix_offset :], skip_special_tokens)
        _take_complete_text(seq, len(ids), prefix, full)

    def detokenize_many(
        self, seqs: list[tuple[Sequence, bool]], keep_stop: Collection[int] = ()
    ) -> None:
        """``detokenize(seq, skip_special_tokens, seq.seq_id in keep_stop)`` for each pair,
        with every window of a step decoded in two batched calls of the tokenizer's Rust
        backend (in parallel, off the GIL) where that gives the same text as ``decode``; one by
        one otherwise."""
        batch = self._batch
        if batch is None:
            for seq, skip in seqs:
                self.detokenize(seq, skip, seq.seq_id in keep_stop)
            return
        for skip in (True, False):
            group = [(seq, _text_ids(seq, seq.seq_id in keep_stop)) for seq, s in seqs if s is skip]
            if not group:
                continue
            prefixes = batch([ids[s.prefix_offset : s.read_offset] for s, ids in group], skip)
            fulls = batch([ids[s.prefix_offset :] for s, ids in group], skip)
            for (seq, ids), prefix, full in zip(group, prefixes, fulls, strict=True):
                _take_complete_text(seq, len(ids), prefix, full)

    def stop_string_hit(self, seq: Sequence, p: SamplingParams, detokenized=False) -> bool:
        """Detokenize seq's new tokens (unless ``detokenized`` already); cut its text at a stop
        string if one appeared (the string recorded as ``seq.stop_reason``)."""
        if not detokenized:
            self.detokenize(seq, p.skip_special_tokens, _keeps_stop(p))
        searched, seq.stop_search_from = seq.stop_search_from, len(seq.text)
        if not p.stop or seq.finish_reason == "stop" or len(seq.text) == searched:
            return False
        if seq.get_output_len() <= getattr(p, "min_tokens", 0):  # vLLM's: none found before
            return False
        at = find_stop_string(seq.text, searched, p.stop)
        if at < 0:
            return False
        seq.stop_reason = stop = next(s for s in p.stop if seq.text.startswith(s, at))
        seq.text = seq.text[: at + len(stop) if p.include_stop_str_in_output else at]
        return True

    def check_stop(self, req: Request, seq: Sequence, detokenized=False) -> str | None:
        """After seq's new token: "stop" for a stop string or a complete grammar, "abort" for a
        grammar no token can continue (structured_output/grammar.py), else None."""
        reason = None
        if req.grammar is not None and not seq.is_finished():
            reason = req.grammar.after_token(seq)
        if self.stop_string_hit(seq, req.params, detokenized):
            reason = "stop"
        if req.grammar is not None and (reason or seq.is_finished()):
            req.grammar.forget(seq)
        return reason

    def check_stops(self, pairs: list[tuple[Request, Sequence]]) -> list[str | None | Exception]:
        """``check_stop`` for each (request, sequence) with a new token in a step, the text of all
        of them decoded together first; a pair that raises gets its exception in its place (it
        fails its request alone)."""
        advance_grammars(pairs)  # every constrained sequence's token and next mask, together
        try:
            keep = {seq.seq_id for req, seq in pairs if _keeps_stop(req.params)}
            self.detokenize_many([(s, req.params.skip_special_tokens) for req, s in pairs], keep)
            detokenized = True
        except Exception:  # decoded one by one below, so that the error is the request's own
            detokenized = False
        out: list[str | None | Exception] = []
        for req, seq in pairs:
            try:
                out.append(self.check_stop(req, seq, detokenized))
            except Exception as err:
                out.append(err)
        return out

    @staticmethod
    def stop_reason(req: Request, seq: Sequence) -> int | str | None:
        """vLLM's stop_reason: the stop token id or stop string that finished seq, or why its
        grammar could go no further; None otherwise (EOS, length, running)."""
        if req.grammar is not None and (why := req.grammar.stop_reasons.get(seq.seq_id)):
            return why
        return seq.stop_reason if seq.finish_reason == "stop" else None

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output as its params' ``output_kind`` asks: everything so far
        (CUMULATIVE, FINAL_ONLY) or what is new since its last output (DELTA)."""
        if req.is_beam_search:
            return self._beam_output(req)
        seqs = req.group.get_seqs()
        p = req.params
        if len(seqs) > p.n:  # best_of: the n of highest cumulative logprob (vLLM V0's)
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: p.n]
        if len(seqs) > 1:
            seqs.sort(key=lambda s: s.sample_index)
        completion = self._delta if p.output_kind is RequestOutputKind.DELTA else self._whole
        completions = [completion(req, s, p.logprobs is not None) for s in seqs]
        prompt_logprobs = self.prompt_logprobs(req)
        if p.output_kind is RequestOutputKind.DELTA and prompt_logprobs is not None:
            if req.sent_prompt_logprobs:
                prompt_logprobs = None  # a delta carries them once
            req.sent_prompt_logprobs = True
        return _request_output(req, completions, req.group.is_finished(), prompt_logprobs)

    def _whole(self, req: Request, s: Sequence, want_logprobs: bool) -> CompletionOutput:
        return CompletionOutput(
            index=s.sample_index,
            text=s.text,
            token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=list(self._logprobs(req, s)) if want_logprobs else None,
            finish_reason=s.finish_reason,
            stop_reason=self.stop_reason(req, s),
        )

    def _delta(self, req: Request, s: Sequence, want_logprobs: bool) -> CompletionOutput:
        """What seq has that its last output did not (vLLM's DELTA). While it runs, the last
        characters that could still begin a stop string are held back: a stop string found
        later cuts the text there, never before what was sent."""
        num_tokens, num_chars = req.sent.get(s.seq_id, (0, 0))
        end = len(s.text)
        if s.finish_reason is None:
            end = max(end - req.params.stop_hold, num_chars)
        req.sent[s.seq_id] = (len(s.output_token_ids), end)
        return CompletionOutput(
            index=s.sample_index,
            text=s.text[num_chars:end],
            token_ids=s.output_token_ids[num_tokens:],
            cumulative_logprob=s.cumulative_logprob,
            logprobs=self._logprobs(req, s)[num_tokens:] if want_logprobs else None,
            finish_reason=s.finish_reason,
            stop_reason=self.stop_reason(req, s),
        )

    def _logprobs(self, req: Request, s: Sequence) -> list[dict[int, Logprob]]:
        """s's generated logprobs as Logprobs, each token's built once (a sequence's logprobs
        only grow), so that successive outputs share their entries."""
        built = req.sample_logprobs.setdefault(s.seq_id, [])
        k = req.params.logprobs
        built += [sample_logprobs_entry(e, k, self.token_text) for e in s.logprobs[len(built) :]]
        return built

    def prompt_logprobs(self, req: Request) -> PromptLogprobsList | None:
        """vLLM's prompt_logprobs, once the whole prompt is scored (built when first read)."""
        state = req.prompt_logprobs
        if state is None or not state.done:
            return None
        if state.output is None:  # its rows are final: a scored row is never scored again
            arrays = (state.logprobs, state.ranks, state.top_token_ids, state.top_logprobs)
            state.output = PromptLogprobsList(state.prompt, *arrays, self.token_text)
        return state.output

    def _beam_output(self, req: Request) -> RequestOutput:
        p = req.params
        finished = req.group.is_finished()
        hyps = list(req.group.finished_beams)
        if not finished or req.error is not None:  # the live beams as they stand
            hyps += [
                (list(s.output_token_ids), s.cumulative_logprob)
                for s in req.group.get_seqs()
                if s.finish_reason in (None, "abort")
            ]

        def reason(tokens: list[int]) -> str | None:
            if not finished:
                return None
            if req.error is not None:
                return "abort"
            return beam_search.finish_reason(p, tokens, self.eos_token_ids)

        completions = [
            CompletionOutput(
                index=i,
                text=self.decode(tokens),
                token_ids=tokens,
                cumulative_logprob=cum,
                logprobs=None,
                finish_reason=reason(tokens),
            )
            for i, (tokens, cum) in enumerate(beam_search.best_hypotheses(p, hyps))
        ]
        return _request_output(req, completions, finished)


def _request_output(req: Request, completions, finished: bool, prompt_logprobs=None):
    return RequestOutput(
        req.request_id,
        req.prompt,
        req.prompt_token_ids,
        completions,
        finished,
        req.error,
        prompt_logprobs,
        metrics=req.metrics,
    )


def _keeps_stop(p) -> bool:
    """Whether the text keeps what stopped it (beam search's keeps its EOS token's, as ever)."""
    return not isinstance(p, SamplingParams) or p.include_stop_str_in_output


def _text_ids(seq: Sequence, keep_stop: bool) -> list[int]:
    """The token ids seq's text is made of: all, but the EOS or stop token id that finished it
    (set by the scheduler before detokenizing) unless ``keep_stop``."""
    ids = seq.get_token_ids()
    if seq.finish_reason == "stop" and not keep_stop:
        return ids[:-1]
    return ids


def _take_complete_text(seq: Sequence, num_ids: int, prefix: str, full: str) -> None:
    """Append what the window's full text adds to its prefix's, once it ends in a whole
    character (a byte-fallback or byte-level token may leave half of one: U+FFFD)."""
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, num_ids


def _batch_decoder(tokenizer):
    """``(ids_lists, skip_special_tokens) -> texts`` through the Rust backend's decode_batch,
    or None where ``tokenizer.decode`` does more than the backend's decode: a tokenizer class
    with its own decoding, or one that cleans up tokenization spaces."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (
        backend is None
        or not isinstance(tokenizer, TokenizersBackend)
        or cls._decode is not TokenizersBackend._decode
        or cls.decode is not TokenizersBackend.decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return None
    return lambda ids, skip: backend.decode_batch(ids, skip_special_tokens=skip)
