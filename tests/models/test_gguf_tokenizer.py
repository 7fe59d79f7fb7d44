"""The embedded GGUF's tokenizer without torch, equal to transformers' gguf_file= tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pagedjax.models.loader import default_model_path, gguf_tokenizer

TEXTS = ["What is the capital of France?", "  héllo\nwörld 😀 <|im_start|> 12345", "a\tb  c", ""]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_path()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        pytest.skip(f"the embedded model is not installed: {e}")


def test_same_ids_text_and_chat_template_as_transformers(gguf_path):
    from transformers import AutoTokenizer

    ours = gguf_tokenizer(gguf_path)
    ref = AutoTokenizer.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kwargs = dict(add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, **kwargs) == ref.apply_chat_template(
        messages, **kwargs
    )
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


def test_needs_no_torch(gguf_path):
    code = (
        "import sys; sys.modules['torch'] = None  # any import of torch now fails\n"
        "from pagedjax.models.loader import gguf_tokenizer\n"
        f"tok = gguf_tokenizer({gguf_path!r})\n"
        "assert tok('Hello')['input_ids']\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_converted_once_then_loaded_from_the_cache(gguf_path, tmp_path, monkeypatch):
    from pagedjax.models.loading import tokenizer

    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    conversions = []
    real = tokenizer.gguf_tokenizer
    monkeypatch.setattr(tokenizer, "gguf_tokenizer", lambda p: conversions.append(p) or real(p))
    first = tokenizer.cached_gguf_tokenizer(Path(gguf_path))
    again = tokenizer.cached_gguf_tokenizer(Path(gguf_path))
    assert len(conversions) == 1  # the second came from the saved copy
    assert list((tmp_path / "tokenizers").iterdir())
    for text in TEXTS:
        assert again(text)["input_ids"] == first(text)["input_ids"], text
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = dict(add_generation_prompt=True, tokenize=False)
    assert again.apply_chat_template(messages, **kwargs) == first.apply_chat_template(
        messages, **kwargs
    )
    assert (again.bos_token_id, again.eos_token_id) == (first.bos_token_id, first.eos_token_id)
