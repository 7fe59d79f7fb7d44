"""Structured output under hostile constraints: bounds checked before llguidance sees anything,
compilation in a worker with its own stack and time budget, one start matcher copied per
sequence, choices of any length, 64-bit integer bounds, non-JSON schemas named. No model: a
byte-level tokenizer (token b is byte b) and fake sequences."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from pagedjax.sampling_params import SamplingParams
from pagedjax.sampling_params import StructuredOutputsParams as SO
from pagedjax.structured_output import masks
from pagedjax.structured_output import worker as structured_worker
from pagedjax.structured_output.grammar import GrammarCompiler, RequestGrammar

VOCAB = 260  # 256 bytes, then <s> </s> <pad> <extra>


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedjax.entrypoints.openai.logprobs import _bytes_to_unicode

    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258, "<extra>": 259})
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def ref_chain(n: int, any_of: bool = False) -> dict:
    def link(i):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"anyOf": [ref, {"type": "null"}]} if any_of else ref

    defs = {f"d{i}": link(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(byte_tokenizer(), VOCAB)


class Seq(types.SimpleNamespace):
    """What RequestGrammar reads of a sequence."""


def walk(compiler, constraint: SO, text: str, seq_id: int = 0) -> list[str | None]:
    """after_token's verdict after each byte of text, fed as a sequence's tokens."""
    grammar = RequestGrammar(compiler.compile(constraint))
    seq = Seq(seq_id=seq_id, output_token_ids=[])
    verdicts = []
    for b in text.encode():
        assert grammar.mask(seq)[b // 32] >> (b % 32) & 1, (text, b)
        seq.output_token_ids.append(b)
        verdicts.append(grammar.after_token(seq))
    return verdicts


_CRASHERS = """
import json, sys
sys.path.insert(0, {tests!r})
from test_structured_output_limits import byte_tokenizer, ref_chain, lark_chain, gbnf_chain
from pagedjax.structured_output import limits as structured_limits
from pagedjax.structured_output.grammar import GrammarCompiler, StructuredOutputsParams as SO
compiler = GrammarCompiler(byte_tokenizer(), 260)
def attempt(make):
    try:
        compiler.compile(make())
        return "compiled"
    except ValueError as e:
        return "ValueError: " + str(e)
out = [attempt(lambda: SO(json=ref_chain(1500))),
       attempt(lambda: SO(json=ref_chain(1500, any_of=True))),
       attempt(lambda: SO(grammar=lark_chain(3000))),
       attempt(lambda: SO(grammar=gbnf_chain(5000))),
       attempt(lambda: SO(grammar="start: %json " + json.dumps(ref_chain(1500, any_of=True))))]
structured_limits.MAX_RULE_CHAIN = 10**6  # past the bounds: the worker's own stack holds it
out.append(attempt(lambda: SO(grammar=lark_chain(3000))))
print(json.dumps(out))
"""


def test_deep_ref_and_rule_chains_are_refused_not_a_crash():
    """Issue 41, item 1: these overflowed the stack inside llguidance (SIGSEGV)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = _CRASHERS.format(tests=tests)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    ref, any_of, lark, gbnf, embedded, unbounded = json.loads(run.stdout.strip().splitlines()[-1])
    for got in (ref, any_of):
        assert got.startswith("ValueError: structured_outputs.json: the schema's depth"), got
        assert "over the limit of 100" in got
    assert lark.startswith("ValueError: structured_outputs.grammar: the longest chain"), lark
    assert "is at least 257, over the limit of 256" in lark
    assert "is at least 257, over the limit of 256" in gbnf
    assert embedded.startswith("ValueError: structured_outputs.grammar: the %json schema at "), (
        embedded
    )
    assert "depth ($ref hops included) is at least 101, over the limit of 100" in embedded
    assert unbounded == "compiled"


def test_a_deeply_nested_schema_string_is_a_value_error():
    """Item 8: json.loads raised RecursionError (a 500 on the server)."""
    deep = '{"a": ' * 5000 + "1" + "}" * 5000
    with pytest.raises(ValueError, match="nesting depth is 5000, over the limit of 100"):
        SO(json=deep)
    nested: dict = {"type": "integer"}
    for _ in range(2000):
        nested = {"anyOf": [nested]}
    with pytest.raises(ValueError, match="structured_outputs.json: .*over the limit of 100"):
        SO(json=nested)


def test_the_deepest_schema_allowed_compiles(compiler):
    schema: dict = {"type": "integer"}
    for _ in range(49):  # 99 levels: an object and a list each
        schema = {"anyOf": [schema]}
    copy.deepcopy(SamplingParams(structured_outputs=SO(json=schema)))  # as admission copies it
    assert walk(compiler, SO(json=schema), "7")[-1] is None  # more digits may follow
    with pytest.raises(ValueError, match="nesting depth is at least 101, over the limit of 100"):
        SO(json={"anyOf": [schema]})


def test_compile_budget_and_worker_bound(compiler):
    slow = GrammarCompiler(compiler.tokenizer, VOCAB, budget_s=0.001)
    with pytest.raises(ValueError, match=r"structured_outputs.regex: compiling it took more than"):
        slow.compile(SO(regex="(a{100}){100}"))  # about 0.1 s: the lexer and two masks
    deadline = time.monotonic() + 60
    while structured_worker.running() and time.monotonic() < deadline:  # it runs on, then ends
        time.sleep(0.01)
    assert structured_worker.running() == 0
    release = threading.Event()
    held = []
    for _ in range(structured_worker.MAX_WORKERS):  # threads over budget keep their slots
        with pytest.raises(ValueError, match="took more than"):
            structured_worker.run_bounded(lambda: held.append(release.wait(30)), "x", 0.01)
    try:
        with pytest.raises(ValueError, match="compilations are already running"):
            structured_worker.run_bounded(lambda: 1, "x", 0.05)
        assert structured_worker.running() == structured_worker.MAX_WORKERS
    finally:
        release.set()
    assert structured_worker.run_bounded(lambda: 2, "x", 30) == 2

    def recurse(n=0):
        return recurse(n + 1)

    with pytest.raises(ValueError, match="too deeply nested"):
        structured_worker.run_bounded(recurse, "structured_outputs.json")


def test_one_start_matcher_copied_per_sequence(compiler, monkeypatch):
    """Item 2: every sequence (n, beams, retries) built its own matcher and first mask on the
    engine thread (about 1.2 s each for `(a{1000}){1000}`); now one per grammar, copied."""
    import llguidance

    real, built = llguidance.LLMatcher, []

    class Counting:
        def __call__(self, *args, **kwargs):
            built.append(args[1])
            return real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    constraint = SO(regex="(ab){1,50}c")
    grammar = RequestGrammar(compiler.compile(constraint))
    first = None
    for sid in range(8):
        seq = Seq(seq_id=sid, output_token_ids=[])
        mask = grammar.mask(seq)
        assert first is None or mask is first  # computed once, at admission
        first = mask
        for b in b"abab":
            seq.output_token_ids.append(b)
            assert grammar.after_token(seq) is None
    assert len(built) == 1
    # Compiled once (the server, off the engine thread), it is not compiled again at admission
    # even when the cache has let it go: the params carry it through their copies.
    again = GrammarCompiler(compiler.tokenizer, VOCAB)
    assert again.compile(copy.deepcopy(constraint)) is constraint.compiled
    assert len(built) == 1


def test_a_long_choice_list_works_like_an_enum(compiler):
    """Item 5: over 2,000 choices ended "abort" after one token (one parser alternative each)."""
    words = [f"w{i}" for i in range(2500)]
    assert walk(compiler, SO(choice=words), "w1234") == [None] * 4 + ["stop"]
    assert walk(compiler, SO(choice=words), "w24")[-1] is None  # w240..w249 may follow


def test_a_grammar_over_the_library_limits_is_refused_at_admission(compiler):
    """Item 14: admitted, then "abort" after one token; now a ValueError (a 400)."""
    with pytest.raises(ValueError, match=r"nested repetition count is 1000000, over the limit"):
        compiler.compile(SO(regex="(a{1000}){1000}"))
    with pytest.raises(ValueError, match="regex /.*nested repetition count"):
        compiler.compile(SO(grammar="start: X\nX: /(a{1000}){1000}/"))
    rules = "start: " + " | ".join(f'"w{i}"' for i in range(2500))  # 2,500 items in one row
    with pytest.raises(ValueError, match="grammar is beyond the grammar library's limits"):
        compiler.compile(SO(grammar=rules))


def test_integer_bounds_beyond_64_bits(compiler):
    """Item 6: [1e30, 1e31] gave 9223372036854775807 with finish "stop". The library keeps
    bounds as 64-bit floats: [2**62, 2**62 + 5] allowed only 2**62 + 0 and 2**62 + 1024 ...;
    bounds are exact up to 2**53, refused beyond."""
    schema = {"type": "integer", "minimum": 1e30, "maximum": 1e31}
    with pytest.raises(ValueError, match=r"schema\['minimum'\] is 1e\+30, beyond the range"):
        compiler.compile(SO(json=schema))
    with pytest.raises(ValueError, match=r"is 4611686018427387904, beyond .*2\*\*53"):
        SO(json={"type": "integer", "minimum": 2**62, "maximum": 2**62 + 5})
    nested = {
        "type": "object",
        "properties": {"n": {"type": ["integer", "null"], "maximum": -2e19}},
    }
    with pytest.raises(ValueError, match=r"\['properties'\]\['n'\]\['maximum'\]"):
        SO(json=nested)
    top = 2**53
    exact = {"type": "integer", "minimum": top - 6, "maximum": top}  # honoured to the unit
    assert walk(compiler, SO(json=exact), str(top - 3))[-1] == "stop"
    assert walk(compiler, SO(json=exact), str(top))[-1] == "stop"
    assert SO(json={"enum": [10**40]}).json  # a data value, not a bound


def test_a_set_is_named_and_json_true_means_any_json(compiler):
    """Item 15: a set raised TypeError; json=True was refused with a library message."""
    schema = {"type": "object", "properties": {"color": {"enum": {"red", "green"}}}}
    with pytest.raises(ValueError, match=r"schema\['properties'\]\['color'\]\['enum'\] is a set"):
        SO(json=schema)
    params = SO(json={"type": "string"})
    params.json = {"enum": {1, 2}}  # changed after construction: compile still names it
    with pytest.raises(ValueError, match="structured_outputs.json"):
        compiler.compile(params)
    assert walk(compiler, SO(json=True), '[1, "a"]')[-1] == "stop"
    assert walk(compiler, SO(json=True), '"x"')[-1] == "stop"


def test_a_schema_deepened_after_its_check_is_still_a_value_error(compiler):
    """Item 8 by another way: fields changed after construction reach copy and compile."""
    from pagedjax.engine.input_processor import Capacity, InputProcessor

    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"not": deep}
    params = SamplingParams(structured_outputs=SO(json={"type": "string"}))
    params.structured_outputs.json = deep
    cap = Capacity(64, 4, 64, True, 16, 32, 30, 0, VOCAB)
    with pytest.raises(ValueError, match="nested too deeply to copy"):
        InputProcessor(cap).copy_params(params)
    with pytest.raises(
        ValueError, match="structured_outputs.json: nested more than the limit of 100"
    ):
        compiler.compile(params.structured_outputs)


def test_masks_computed_together_equal_one_by_one(compiler):
    """A step's sequences advanced together (masks.advance_together: every grammar, samples of
    one grammar diverging) take the same tokens, masks and verdicts as one by one."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    schema["additionalProperties"] = False
    constraints = [SO(regex="[a-c]{2,5}-[0-9]{1,3}"), SO(json=schema), SO(choice=["ab", "abc"])]
    constraints.append(constraints[0])  # a second sample of the regex
    together = [RequestGrammar(compiler.compile(c)) for c in constraints]
    together[3] = together[0]  # one request's grammar, two sequences
    alone = [RequestGrammar(compiler.compile(c)) for c in constraints]
    seqs = [Seq(seq_id=i, output_token_ids=[]) for i in range(len(constraints))]
    rng, live = random.Random(0), list(range(len(seqs)))
    while live:
        for i in live:
            allowed = alone[i].mask(seqs[i])
            assert (together[i].mask(seqs[i]) == allowed).all()
            bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")
            seqs[i].output_token_ids.append(rng.choice(np.flatnonzero(bits[:256]).tolist()))
        masks.advance_together([(together[i], seqs[i]) for i in live])
        verdicts = {
            i: (together[i].after_token(seqs[i]), alone[i].after_token(seqs[i])) for i in live
        }
        assert all(a == b for a, b in verdicts.values()), verdicts
        live = [i for i in live if verdicts[i][0] is None and len(seqs[i].output_token_ids) < 40]
    assert re.fullmatch("[a-c]{2,5}-[0-9]{1,3}", bytes(seqs[0].output_token_ids).decode())
    assert seqs[0].output_token_ids != seqs[3].output_token_ids
    assert bytes(seqs[1].output_token_ids).decode().startswith('{"a": ')


def test_a_schema_the_library_panics_on_is_refused_not_a_500(compiler):
    """The library panics (a Rust panic: a BaseException, no handler caught it, a 500) when the
    message of its error about this "$ref" cuts a 4-byte character in two."""
    schema = {
        "$ref": {"000\x1f\x1f\x1f\x1f\x1f": None, "00\x1f\x1f\x1f\x1f\x1f\x1f\x1f\x07𐀀𐀀": None}
    }
    with pytest.raises(ValueError, match=r"structured_outputs.json: the grammar library failed"):
        compiler.compile(SO(json=schema))
