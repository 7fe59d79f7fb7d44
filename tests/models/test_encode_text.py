"""``encode_text``: a prompt's ids through the tokenizer's Rust backend, the same as
``tokenizer(text)["input_ids"]`` for every tokenizer and setting."""

from __future__ import annotations

import pytest
from pagedjax.models.loader import default_model_path, encode_text, gguf_tokenizer
from pagedjax.models.loading import tokenizer as tokenizer_module
from server_helpers import CHAT_TEMPLATE, save_byte_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedjax.bench.serve_model import save_word_tokenizer

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


def test_a_texts_length_bounds_its_tokens_from_below(tok):
    """``max_chars_per_token`` k: no text of c characters encodes to fewer than c / k tokens,
    even one made of the tokenizer's longest tokens or of added tokens; the word tokenizer
    (a word of any length may be one unknown token) gives no bound."""
    import random

    k = tokenizer_module.max_chars_per_token(tok)
    if k is None:
        assert type(tok.backend_tokenizer.model).__name__ == "WordLevel"
        return
    longest = max(tok.get_vocab(), key=len)
    texts = [
        tok.convert_tokens_to_string([longest]) * 50,
        "".join(t.content for t in tok.added_tokens_decoder.values()) * 20,
        *TEXTS,
    ]
    rng = random.Random(0)
    texts += ["".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(2000)) for _ in range(3)]
    for text in texts:
        assert len(encode_text(tok, text, False)) * k >= len(text), text[:40]


def test_parts_that_can_drop_characters_give_no_bound(tmp_path):
    from tokenizers import AddedToken, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    assert tokenizer_module.max_chars_per_token(_byte(tmp_path)) == 7  # "<extra>"
    changes = {
        "normalizer": [normalizers.Strip(), normalizers.Replace("  ", " ")],
        "pre_tokenizer": [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(" ", "removed"),
            pre_tokenizers.Punctuation("removed"),
        ],
        "model": [BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)],
    }
    for part, values in changes.items():
        for value in values:
            tok = _byte(tmp_path)
            setattr(tok.backend_tokenizer, part, value)
            assert tokenizer_module.max_chars_per_token(tok) is None, (part, value)
    tok = _byte(tmp_path)  # an added token that takes the spaces before it: " " * c + "<m>"
    tok.add_tokens([AddedToken("<m>", lstrip=True)])
    assert len(encode_text(tok, " " * 2000 + "<m>", False)) == 1
    assert tokenizer_module.max_chars_per_token(tok) is None
