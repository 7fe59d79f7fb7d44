"""Detokenizing a step's sequences together (OutputProcessor.detokenize_many / check_stops) gives,
token by token, the same text, stop strings and stop reasons as detokenizing them one by one."""

from __future__ import annotations

import random
import types

import pytest
from server_helpers import save_byte_tokenizer
from transformers import AutoTokenizer

from pagedjax.core.sequence import Sequence
from pagedjax.engine import output_processor as op
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes-tok")
    save_byte_tokenizer(path, "")
    return AutoTokenizer.from_pretrained(path)


def utf8_tokens(rng: random.Random, n: int) -> list[int]:
    """Bytes of random text with multi-byte characters, plus the odd special token."""
    text = "".join(rng.choice(["a", " b", "é", "字", "\U0001f600", "\n", "stop"]) for _ in range(n))
    ids = list(text.encode())
    for _ in range(n // 8):
        ids.insert(rng.randrange(len(ids)), rng.choice([256, 257, 259]))
    return ids


class CountingBackend:
    """The tokenizer's backend, counting decode_batch calls."""

    def __init__(self, backend):
        self.backend, self.calls = backend, 0

    def decode_batch(self, ids, skip_special_tokens):
        self.calls += 1
        return self.backend.decode_batch(ids, skip_special_tokens=skip_special_tokens)


def test_batched_detokenization_matches_one_by_one(byte_tokenizer, monkeypatch):
    counting = CountingBackend(byte_tokenizer.backend_tokenizer)
    real = op._batch_decoder
    monkeypatch.setattr(
        op,
        "_batch_decoder",
        lambda tok: real(tok) and (lambda ids, skip: counting.decode_batch(ids, skip)),
    )
    proc = OutputProcessor(byte_tokenizer, eos_token_ids={257})
    rng = random.Random(0)
    streams = [utf8_tokens(rng, 30) for _ in range(12)]
    skips = [i % 3 != 0 for i in range(12)]
    one = [Sequence(i, [10, 11, 12], 8) for i in range(12)]
    many = [Sequence(i, [10, 11, 12], 8) for i in range(12)]
    steps = max(len(s) for s in streams)
    for t in range(steps):
        live = [i for i in range(12) if t < len(streams[i])]
        for i in live:
            one[i].append_token_id(streams[i][t], 0.0)
            many[i].append_token_id(streams[i][t], 0.0)
            proc.detokenize(one[i], skips[i])
        proc.detokenize_many([(many[i], skips[i]) for i in live])
        assert [s.text for s in many] == [s.text for s in one], t
    assert counting.calls > 0  # the batched path ran (two calls per skip group and step)
    assert counting.calls <= 4 * steps
    for i in range(12):  # and the text is the tokenizer's own
        full = byte_tokenizer.decode(streams[i], skip_special_tokens=skips[i])
        assert one[i].text == full.rstrip("\ufffd"), i


def test_check_stops_cuts_at_stop_strings_and_isolates_a_failing_request(byte_tokenizer):
    proc = OutputProcessor(byte_tokenizer, eos_token_ids={257})
    params = SamplingParams(stop=["stop"])
    req = types.SimpleNamespace(params=params, grammar=None)

    class Broken:
        params = SamplingParams()

        @property
        def grammar(self):
            raise RuntimeError("grammar state lost")

    seqs = [Sequence(i, [10], 8) for i in range(3)]
    reasons = []
    for b in b"say stop now":
        for s in seqs:
            s.append_token_id(b, 0.0)
        pairs = [(req, seqs[0]), (Broken(), seqs[1]), (req, seqs[2])]
        reasons = proc.check_stops(pairs)
        if reasons[0] == "stop":
            break
    assert reasons[0] == reasons[2] == "stop"
    assert isinstance(reasons[1], RuntimeError)
    assert seqs[0].text == seqs[2].text == "say "
    assert seqs[0].stop_reason == "stop"


def test_tokenizers_that_decode_their_own_way_are_decoded_one_by_one(byte_tokenizer):
    class Custom(type(byte_tokenizer)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    assert op._batch_decoder(byte_tokenizer) is not None
    custom = Custom(tokenizer_object=byte_tokenizer.backend_tokenizer)
    assert op._batch_decoder(custom) is None
    byte_tokenizer.clean_up_tokenization_spaces = True
    try:
        assert op._batch_decoder(byte_tokenizer) is None
    finally:
        byte_tokenizer.clean_up_tokenization_spaces = False
