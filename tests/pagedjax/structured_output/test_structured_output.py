"""Structured output offline: JSON schema, regex, choice and grammar constraints on a tiny
random model with a byte-level tokenizer (every byte a token), with n > 1, preemption, and errors
named at admission."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hf_models import make_tiny_model, save_word_tokenizer
from server_helpers import BYTE_CHARS, make_byte_model

from pagedjax import LLM
from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams
from pagedjax.structured_output.grammar import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
PROMPTS = ["Hello", "A person:", "caf\u00e9"]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("so_byte_llama")
    make_byte_model(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(byte_model):
    # A small pool: batches of several sequences preempt (recompute one, swap n > 1).
    return LLM(byte_model, block_size=8, num_blocks=48, max_model_len=128, seed=0)


def so(**kwargs):
    return StructuredOutputsParams(**kwargs)


def params(constraint, **kwargs):
    kwargs.setdefault("max_tokens", 80)
    return SamplingParams(structured_outputs=constraint, **kwargs)


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def assert_json_valid(outs):
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_schema_greedy_and_sampled_n3(llm):
    assert_json_valid(llm.generate(PROMPTS, params(so(json=SCHEMA), temperature=0), use_tqdm=False))
    sampled = params(so(json=json.dumps(SCHEMA)), temperature=1.0, n=3, seed=5)
    outs = llm.generate(PROMPTS, sampled, use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in outs)
    assert_json_valid(outs)
    assert len(set(texts(outs))) > 3  # the samples differ
    obj = llm.generate(PROMPTS[0], params(so(json_object=True), temperature=0), use_tqdm=False)
    c = obj[0].outputs[0]
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)


def test_regex_choice_and_grammar(llm):
    for temperature in (0.0, 1.0):
        outs = llm.generate(
            PROMPTS, params(so(regex=REGEX), temperature=temperature, n=2, seed=1), use_tqdm=False
        )
        assert all(re.fullmatch(REGEX, t) for t in texts(outs)), texts(outs)
        outs = llm.generate(
            PROMPTS, params(so(choice=CHOICES), temperature=temperature, seed=2), use_tqdm=False
        )
        assert all(t in CHOICES for t in texts(outs))
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
        outs = llm.generate(
            PROMPTS, params(so(grammar=LARK), temperature=temperature, seed=3), use_tqdm=False
        )
        for t in texts(outs):
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t), t
    # A complete grammar ends the sequence even when EOS is ignored: no run to max_tokens.
    out = llm.generate(
        PROMPTS[0], params(so(choice=CHOICES), temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_constraints_compile_no_program_per_request(llm):
    llm.generate(PROMPTS, params(so(regex=REGEX), temperature=0), use_tqdm=False)
    before = llm.get_stats().num_compilations
    other = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    llm.generate(PROMPTS, params(so(json=other), temperature=0), use_tqdm=False)
    llm.generate(PROMPTS, params(so(choice=["a", "b"]), temperature=0), use_tqdm=False)
    assert llm.get_stats().num_compilations == before


def test_preemption_keeps_outputs_valid_and_greedy_unchanged(llm):
    greedy = params(so(json=SCHEMA), temperature=0, ignore_eos=True)
    prompts = [p * 4 for p in PROMPTS] * 2
    alone = [llm.generate(p, greedy, use_tqdm=False)[0] for p in prompts[:3]]
    before = llm.get_stats().num_preemptions
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.get_stats().num_preemptions > before
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone] * 2
    assert_json_valid(outs)


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "wat"}}}), "JSON schema"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json="null"), "an output can match"),  # the server's request waited forever
        (dict(json="false"), "an output can match"),
        (dict(regex="(ab"), "regex"),
        (dict(grammar="start: ("), "grammar"),
        (dict(choice=[]), "choice"),
        (dict(), "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
    ],
)
def test_bad_constraints_are_value_errors(llm, constraint, message):
    with pytest.raises(ValueError, match=f"structured_outputs.*{message}"):
        llm.generate(PROMPTS[0], params(so(**constraint)), use_tqdm=False)
    assert llm.get_stats().num_blocks_used == 0


def save_digitless_tokenizer(directory) -> None:
    """A byte-level tokenizer without the ten digit bytes: 246 bytes, then <s> </s> <pad> (the
    model's EOS, 257, stays one too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [BYTE_CHARS[b] for b in range(256) if not chr(b).isdigit()]
    vocab = {c: i for i, c in enumerate([*chars, "<s>", "</s>", "<pad>"])}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(directory)


def test_a_grammar_the_vocabulary_cannot_spell(tmp_path):
    # The byte model (its config, so its compiled programs) with a tokenizer that has no digits.
    make_tiny_model("llama_gqa", tmp_path, vocab_size=260, bos_token_id=256, eos_token_id=257)
    save_digitless_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), block_size=8, num_blocks=48, max_model_len=128, seed=0)
    with pytest.raises(ValueError, match="structured_outputs.regex: .* allows no first token"):
        llm.generate("hi", params(so(regex="[0-9]+")), use_tqdm=False)
    # A dead end later on ends the sequence at once, with its reason.
    out = llm.generate("hi", params(so(regex="ab[0-9]"), temperature=0), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == "ab" and c.finish_reason == "abort" and "continue" in c.stop_reason
    assert out.error is None and llm.get_stats().num_blocks_used == 0


def test_a_tokenizer_llguidance_cannot_read_is_named(tmp_path):
    save_word_tokenizer(tmp_path)  # word-level: not a byte-level or SentencePiece vocabulary
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tmp_path), 256)
    with pytest.raises(ValueError, match="structured_outputs: .*tokenizer is not supported"):
        compiler.compile(so(regex="[0-9]+"))
    with pytest.raises(ValueError, match="structured_outputs: this model has no tokenizer"):
        GrammarCompiler(None, 256).compile(so(regex="[0-9]+"))


def test_a_snapshot_restores_the_grammar_state(llm, tmp_path):
    from pagedjax.inspection.state import Snapshot

    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"snap{i}", p, params(so(json=SCHEMA), temperature=0.7, seed=i))
    for _ in range(6):
        engine.step()
    snap = engine.snapshot()
    snap.save(tmp_path / "snap.pkl")

    def finish():
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].text
        return done

    first = finish()
    engine.restore(Snapshot.load(tmp_path / "snap.pkl"))  # matchers rebuilt from the tokens
    assert finish() == first
    for text in first.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def count_mask_calls(monkeypatch) -> list[int]:
    """Rows of every call that computes grammar masks (one per call of the one-matcher form)."""
    import llguidance.numpy

    calls: list[int] = []
    one, many = (
        llguidance.numpy.fill_next_token_bitmask,
        llguidance.numpy.fill_next_token_bitmask_par,
    )

    def fill_one(matcher, bitmask, index=0):
        calls.append(1)
        return one(matcher, bitmask, index)

    def fill_many(executor, matchers, bitmask):
        calls.append(len(matchers))
        return many(executor, matchers, bitmask)

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", fill_one)
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", fill_many)
    return calls


def test_a_steps_masks_are_computed_in_one_call(llm, monkeypatch):
    """Issue 41 item 2: each sequence's mask was computed on its own, one native call after
    another on the engine thread (a request with n = 8 held every stream 8 masks long); now
    a step's constrained sequences, of every request, get their masks in one call."""
    engine = llm.engine
    constraints = [so(regex=REGEX), so(json=SCHEMA)]
    for c in constraints:
        engine.input_processor.grammars.compile(c)  # first masks: computed at admission
    calls = count_mask_calls(monkeypatch)
    engine.add_request("masks-n4", PROMPTS[0], params(constraints[0], n=4, temperature=1.0, seed=7))
    engine.add_request("masks-json", PROMPTS[1], params(constraints[1], temperature=0))
    steps, outs = 0, {}
    while engine.has_unfinished_requests():
        steps += 1
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert all(re.fullmatch(REGEX, c.text) for c in outs["masks-n4"].outputs)
    assert_json_valid([outs["masks-json"]])
    assert len(calls) <= steps, (calls, steps)  # one call a step at most
    assert max(calls) >= 5  # the four samples and the JSON request together


def test_a_grammar_past_the_parser_limits_ends_its_own_request(llm):
    """An ambiguous grammar's work per token grows with the length (about the cube of the items
    in an Earley row): with llguidance's default row limit one sequence took 0.3-0.5 s a token
    before it ended. The row limit (structured_limits.MASK_ROW_ITEMS) ends that request, named,
    early; a request sharing its steps gets the tokens it gets alone."""
    ambiguous = so(grammar='start: x "!"\nx: x x x | x x | "a" | "b"')
    no_end = {ord("!"): -100.0, 257: -100.0}  # never "!" nor EOS: a longer and longer parse
    plain = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], plain, use_tqdm=False)[0].outputs[0].token_ids
    bomb = params(ambiguous, temperature=0, max_tokens=110, logit_bias=no_end)
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], [bomb, plain], use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.finish_reason == "abort" and len(c.token_ids) < 110, (c.finish_reason, c.text)
    assert set(c.text) <= set("ab") and "limits" in c.stop_reason and "items" in c.stop_reason
    assert outs[1].outputs[0].token_ids == alone
    assert llm.get_stats().num_blocks_used == 0
