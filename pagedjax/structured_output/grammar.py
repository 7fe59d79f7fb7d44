"""Structured output: sampling constrained to a JSON schema, a regex, a choice or a grammar.

The library is llguidance (docs/STRUCTURED_OUTPUT.md says why), imported only when a request asks.
Host side, pure Python and numpy; no jax.

- Admission (``InputProcessor.check``) compiles the constraint once per spec (cached) with the
  model's tokenizer: an invalid schema, regex or grammar, one over the bounds llguidance can build
  safely (structured_limits.py, checked first), or one that allows no first token of this
  vocabulary, is a ``ValueError`` naming what is wrong (a 400 on the server). Compiling runs in a
  worker thread with a stack and a time budget of its own (structured_worker.py).
- Each request keeps one matcher per sequence (``RequestGrammar``), a copy of the grammar's start
  matcher, advanced on the host as tokens are accepted (after each step) and rebuilt (copied
  again) from the sequence's tokens whenever it is missing or behind (the n samples' forks, a
  restored snapshot); recompute after preemption keeps the tokens, so the state follows. The
  first mask is computed once per grammar, at admission; after each step the new tokens and next
  masks of all constrained sequences are computed together, in parallel with the GIL released,
  each mask's work bounded by llguidance's parser limits (masks.py, structured_limits.py).
- Before each step every constrained row carries its packed int32 bitmask [ceil(vocab / 32)] of
  allowed tokens, which the sampler applies on device as a fixed-shape input (sampler.py).
- Ending: once the grammar is complete and takes nothing more, the sequence finishes "stop" (no EOS
  token needed); if no token can continue it (a grammar this vocabulary cannot spell), it finishes
  "abort" with the reason in ``CompletionOutput.stop_reason``. Never an endless loop: ``max_tokens``
  still bounds a grammar that could go on ("length").

JSON is generated in one style: ", " and ": " between items, no other whitespace (free whitespace
lets small models loop on newlines).
"""

from __future__ import annotations

import collections
import copy
import json
import threading
from typing import Any

import numpy as np

from pagedjax.structured_output import limits as structured_limits
from pagedjax.structured_output import masks as step_masks
from pagedjax.structured_output import structural_tag
from pagedjax.structured_output import worker as structured_worker
from pagedjax.structured_output.lark import grammar_lark
from pagedjax.structured_output.masks import mask_width
from pagedjax.structured_output.params import (  # noqa: F401 (grammar's names, re-exported)
    JSON_STYLE,
    KINDS,
    StructuredOutputsParams,
)

_CACHE_SIZE = 128


class TokenizerSpec:
    """What llguidance's tokenizer is built from (the HF fast tokenizer as JSON, the vocabulary
    size and EOS); it pickles, and the built tokenizer is shared by every equal spec."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None):
        self.tokenizer_json, self.vocab_size, self.eos_token_id = (
            tokenizer_json,
            vocab_size,
            eos_token_id,
        )
        self.key = (hash(tokenizer_json), vocab_size, eos_token_id)

    @classmethod
    def of(cls, tokenizer, vocab_size: int) -> TokenizerSpec:
        backend = copy.copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), vocab_size, tokenizer.eos_token_id)

    def build(self):
        with _BUILT_LOCK:
            built = _BUILT.get(self.key)
            if built is None:
                import llguidance

                built = _BUILT[self.key] = llguidance.LLTokenizer(
                    self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return built

    def __getstate__(self):
        return (self.tokenizer_json, self.vocab_size, self.eos_token_id)

    def __setstate__(self, state):
        self.__init__(*state)


_BUILT: dict[tuple, Any] = {}  # TokenizerSpec.key -> llguidance.LLTokenizer
_BUILT_LOCK = threading.Lock()


class CompiledGrammar:
    """A checked llguidance grammar with its tokenizer; immutable and shared (copies are it).
    It keeps one matcher at the start (its lexer built, its first mask computed) that every
    sequence's matcher is copied from: building a matcher and its first mask can take a second
    for a large grammar, a copy takes microseconds. It pickles (engine snapshots) by its grammar
    and tokenizer spec; the start matcher is rebuilt on first use."""

    def __init__(self, grammar: str, tokenizer: TokenizerSpec, description: str):
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.ll_tokenizer = tokenizer.build()
        self.vocab_size = tokenizer.vocab_size
        self.description = description
        self.key: tuple[str, str] | None = None  # the constraint's key (set by its compiler)
        self._start = None  # the matcher before any token; never advanced
        self._first_mask: np.ndarray | None = None  # i32[ceil(vocab / 32)], read-only
        self._start_lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return CompiledGrammar, (self.grammar, self.tokenizer, self.description)

    def _started(self):
        with self._start_lock:
            if self._start is None:
                import llguidance

                start = llguidance.LLMatcher(
                    self.ll_tokenizer,
                    self.grammar,
                    log_level=0,
                    limits=structured_limits.parser_limits(),
                )
                mask = np.zeros(mask_width(self.vocab_size), np.int32)
                if not start.is_error():
                    mask = step_masks.fill([start], self.vocab_size)[0]
                mask.flags.writeable = False
                self._start, self._first_mask = start, mask
            return self._start

    def new_matcher(self):
        """A matcher before any token: a copy of the start matcher."""
        return self._started().deep_copy()

    def first_mask(self) -> np.ndarray:
        """i32[ceil(vocab / 32)] (read-only): the tokens allowed first."""
        self._started()
        return self._first_mask


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary (one per engine); safe
    to call from several threads (the server checks requests on its own thread)."""

    def __init__(self, tokenizer, vocab_size: int, budget_s: float = structured_worker.BUDGET_S):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.budget_s = budget_s  # the most seconds one constraint may take to compile
        self._spec: TokenizerSpec | None = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()

    def tokenizer_spec(self) -> TokenizerSpec:
        """The tokenizer's spec, its llguidance tokenizer built (once, about 1 s for 49k
        tokens); ValueError if there is none or llguidance cannot read it."""
        with self._lock:
            if self._spec is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs: this model has no tokenizer")
                try:
                    import llguidance  # noqa: F401
                except ImportError as e:
                    raise ValueError(
                        f"structured_outputs needs llguidance (pip install llguidance): {e}"
                    ) from None
                try:
                    spec = TokenizerSpec.of(self.tokenizer, self.vocab_size)
                    spec.build()
                except Exception as e:
                    raise ValueError(
                        f"structured_outputs: this model's tokenizer is not supported "
                        f"({type(e).__name__}: {e})"
                    ) from None
                self._spec = spec
            return self._spec

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint (also kept on ``params.compiled``); ValueError naming what is
        wrong with it."""
        if not isinstance(params, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {params!r}")
        key = params.key()
        if self._compiled_before(params, key):  # kept even if the cache let it go
            return params.compiled
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            params.check_limits()  # the fields may have changed since construction
            spec = self.tokenizer_spec()  # built once, outside the compile budget
            what = f"structured_outputs.{params.kind}"
            compiled = structured_worker.run_bounded(
                lambda: self._compile(params, spec), what, self.budget_s
            )
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        params.compiled = compiled
        return compiled

    def _compiled_before(self, params: StructuredOutputsParams, key: tuple[str, str]) -> bool:
        """Whether params carry this constraint compiled for this tokenizer (the server compiles
        it off the engine thread; copies of the params keep it)."""
        compiled = params.compiled
        if compiled is None or compiled.key != key:
            return False
        return compiled.tokenizer.key == self.tokenizer_spec().key

    def _compile(self, params: StructuredOutputsParams, spec: TokenizerSpec) -> CompiledGrammar:
        """Runs in a worker thread (structured_worker.py): llguidance recurses natively. A panic
        of the library (a Rust panic is a BaseException in Python: a 500 that no handler caught)
        is the constraint's fault: a ValueError naming its field."""
        kind, what = params.kind, _DESCRIPTIONS[params.kind]
        try:
            return self._compile_checked(params, spec)
        except BaseException as e:
            if type(e).__name__ != "PanicException":
                raise
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ValueError(
                f"structured_outputs.{kind}: the grammar library failed on this {what}: {reason}"
            ) from None

    def _compile_checked(
        self, params: StructuredOutputsParams, spec: TokenizerSpec
    ) -> CompiledGrammar:
        import llguidance

        kind, what = params.kind, _DESCRIPTIONS[params.kind]
        grammar = _grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, spec.build(), limits=structured_limits.parser_limits()
        )
        if is_error:
            raise ValueError(f"structured_outputs.{kind}: invalid {what}: {messages[0]}")
        compiled = CompiledGrammar(grammar, spec, what)
        compiled.key = params.key()
        matcher = compiled.new_matcher()
        dead = _first_line(matcher).startswith("NoExtension") if matcher.is_error() else False
        if matcher.is_error() and not dead:
            raise ValueError(f"structured_outputs.{kind}: invalid {what}: {_first_line(matcher)}")
        if dead or not compiled.first_mask().any():
            raise ValueError(
                f"structured_outputs.{kind}: the {what} allows no first token of this model's "
                "vocabulary"
            )
        _probe_one_token(compiled, matcher, f"structured_outputs.{kind}")
        return compiled


def _grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for params. A choice is one lexeme (a terminal of alternatives, as a
    JSON enum is), so any number of choices fits; as parser alternatives llguidance takes at
    most 2,000."""
    import llguidance

    kind, what = params.kind, _DESCRIPTIONS[params.kind]
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if schema is True:  # any JSON value: the empty schema
                schema = {}
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides=params.json_style()
            )
        if kind == "structural_tag":
            return structural_tag.grammar_text(params.structural_tag, JSON_STYLE)
        if kind == "choice":
            words = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {words}")
        if kind == "grammar":
            return grammar_lark(params.grammar)
        return llguidance.grammar_from(kind, getattr(params, kind))
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: invalid {what}: {e}") from None


def _probe_one_token(compiled: CompiledGrammar, start, name: str) -> None:
    """Take the first allowed token on a copy of the start matcher and compute the next mask: a
    grammar over llguidance's limits (lexer states, items per row) fails here, at admission,
    instead of ending every sequence "abort" after one token."""
    matcher = start.deep_copy()
    token = int(
        np.flatnonzero(np.unpackbits(compiled.first_mask().view(np.uint8), bitorder="little"))[0]
    )
    matcher.consume_token(token)
    if not matcher.is_error() and not matcher.is_stopped():
        step_masks.fill([matcher], compiled.vocab_size)
    if matcher.is_error() and not _first_line(matcher).startswith("NoExtension"):
        raise ValueError(
            f"{name}: the {compiled.description} is beyond the grammar library's limits: "
            f"{_first_line(matcher)}"
        )


_DESCRIPTIONS = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


# Words of llguidance's errors for its parser limits ("Current row has 502 items; max is 500",
# "Too many items (limit 50000; mask)", "too many states: 300 >= 300", lexer fuel).
_LIMIT_WORDS = ("max is", "limit", "too many", "fuel")


def _first_line(matcher) -> str:
    return matcher.get_error().strip().split("\n", 1)[0]


class RequestGrammar:
    """One request's grammar state: a matcher per sequence, kept in step with its tokens. After
    a step the engine advances every constrained sequence at once (``masks.advance_together``);
    ``after_token`` and ``mask`` do here, one sequence at a time, only what that left undone
    (a restored snapshot, a sequence advanced by other means)."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self._matchers: dict[int, Any] = {}  # seq_id -> matcher
        self._consumed: dict[int, int] = {}  # seq_id -> output tokens the matcher has taken
        self._masks: dict[int, tuple[int, np.ndarray]] = {}  # seq_id -> (consumed, mask)
        self.stop_reasons: dict[int, str] = {}  # seq_id -> why its grammar could go no further

    def __getstate__(self):  # matchers are rebuilt from the tokens (snapshots, copies)
        state = dict(self.__dict__)
        state.update(_matchers={}, _consumed={}, _masks={})
        return state

    def matcher_behind(self, seq) -> tuple[Any, list[int]]:
        """seq's matcher (a fresh copy if missing or ahead of its tokens) and the output tokens
        it has yet to take, counted as taken: the caller makes it take them."""
        sid, tokens = seq.seq_id, seq.output_token_ids
        matcher, done = self._matchers.get(sid), self._consumed.get(sid, 0)
        if matcher is None or done > len(tokens):
            matcher, done = self.compiled.new_matcher(), 0  # a copy: nothing is rebuilt
            self._matchers[sid] = matcher
        self._consumed[sid] = len(tokens)
        return matcher, tokens[done:]

    def _synced(self, seq):
        """seq's matcher after all its output tokens."""
        matcher, behind = self.matcher_behind(seq)
        for t in behind:
            matcher.consume_token(t)
        return matcher

    def wants_mask(self, seq, matcher) -> bool:
        """Whether seq (its matcher synced) samples next and its mask is not yet computed."""
        if not seq.output_token_ids or matcher.is_error() or matcher.is_stopped():
            return False
        cached = self._masks.get(seq.seq_id)
        return cached is None or cached[0] != len(seq.output_token_ids)

    def keep_mask(self, seq, mask: np.ndarray) -> np.ndarray:
        """Keep mask (i32[ceil(vocab / 32)]) as seq's next."""
        self._masks[seq.seq_id] = (len(seq.output_token_ids), mask)
        return mask

    def mask(self, seq) -> np.ndarray:
        """i32[ceil(vocab / 32)]: the tokens seq may sample next."""
        if not seq.output_token_ids:  # computed once per grammar, at admission
            return self.compiled.first_mask()
        matcher = self._synced(seq)
        if self.wants_mask(seq, matcher):
            return self.keep_mask(seq, step_masks.fill([matcher], self.vocab_size)[0])
        cached = self._masks.get(seq.seq_id)
        if cached is not None and cached[0] == len(seq.output_token_ids):
            return cached[1]
        return np.zeros(mask_width(self.vocab_size), np.int32)  # in error or stopped: none

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    def after_token(self, seq) -> str | None:
        """Take seq's new tokens; "stop" if its grammar is complete and can take nothing more,
        "abort" (reason in stop_reasons) if no token can continue it, else None."""
        matcher = self._synced(seq)
        what = self.compiled.description
        if not matcher.is_error() and not matcher.is_stopped():
            self.mask(seq)  # a limit hit computing it is an error, a dead end allows nothing
        if matcher.is_error():
            return self._dead_end(seq, self._error_reason(matcher))
        if matcher.is_stopped():
            if matcher.is_accepting():
                return "stop"
            return self._dead_end(seq, f"the {what} can go no further and is not complete")
        if not self.mask(seq).any():
            return self._dead_end(seq, f"no token of the vocabulary can continue the {what}")
        return None

    def _error_reason(self, matcher) -> str:
        what, why = self.compiled.description, _first_line(matcher)
        if why.startswith("NoExtension"):
            return f"no token of the vocabulary can continue the {what}"
        if any(word in why.lower() for word in _LIMIT_WORDS):
            return f"the {what} is beyond the grammar library's limits: {why}"
        return f"the {what} refused a token: {why}"

    def _dead_end(self, seq, why: str) -> str:
        self.stop_reasons[seq.seq_id] = why
        return "abort"

    def forget(self, seq) -> None:
        for d in (self._matchers, self._consumed, self._masks):
            d.pop(seq.seq_id, None)
