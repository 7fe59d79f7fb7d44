"""``encode_text``: a prompt's ids through the tokenizer's Rust backend, the same as
``tokenizer(text)["input_ids"]`` for every tokenizer and setting."""

from __future__ import annotations

import pytest
from server_helpers import CHAT_TEMPLATE, save_byte_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedjax.bench.serve_model import save_word_tokenizer
from pagedjax.models.loader import default_model_path, encode_text, gguf_tokenizer
from pagedjax.models.loading import tokenizer as tokenizer_module

TEXTS = [
    "What is the capital of France?",
    "  héllo\nwörld 😀 <|im_start|> <s> </s> <extra> 12345",
    "a\tb  c",
    "",
    "w3 w4 w5 w999 zzz",
    "big prompt " * 3000,
]


def _byte(tmp_path):
    save_byte_tokenizer(tmp_path, CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(tmp_path)


def _word(tmp_path):
    save_word_tokenizer(tmp_path, 64)
    return AutoTokenizer.from_pretrained(tmp_path)


def _gguf(tmp_path):
    try:
        return gguf_tokenizer(default_model_path())
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        pytest.skip(f"the embedded model is not installed: {e}")


@pytest.fixture(params=[_byte, _word, _gguf], ids=["byte", "word", "smollm2"])
def tok(request, tmp_path):
    return request.param(tmp_path)


def _same(tok) -> None:
    for text in TEXTS:
        for special in (True, False):
            want = tok(text, add_special_tokens=special)["input_ids"]
            assert encode_text(tok, text, special) == want, (text[:40], special)


def test_the_same_ids_as_the_tokenizer_called(tok):
    assert tokenizer_module._plain_fast(type(tok))  # the backend's path is the one tested
    _same(tok)


def test_settings_that_change_the_ids_go_through_the_tokenizer(tok):
    tok.split_special_tokens = True  # "<s>" as text, not the special token
    _same(tok)
    tok.split_special_tokens = False
    tok._tokenizer.enable_truncation(8)  # a tokenizer.json may carry one; a call turns it off
    assert encode_text(tok, "big prompt " * 10) == tok("big prompt " * 10)["input_ids"]
    assert len(encode_text(tok, "big prompt " * 10)) > 8


def test_a_subclass_that_changes_the_encoding_is_called_as_it_is(tmp_path):
    class Shouting(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.upper(), *args, **kwargs)

    save_byte_tokenizer(tmp_path, CHAT_TEMPLATE)
    tok = Shouting.from_pretrained(tmp_path)
    assert not tokenizer_module._plain_fast(Shouting)
    assert encode_text(tok, "abc") == tok("abc")["input_ids"] == list(b"ABC")
