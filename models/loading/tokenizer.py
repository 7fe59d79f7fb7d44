"""A model's tokenizer: transformers' for a checkpoint directory; for a GGUF, one built from the
file's metadata (no torch), converted once and cached."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .cache import cache_key, cache_root
from .gguf import gguf_reader

if TYPE_CHECKING:
    from .loaded import LoadedModel


def load_tokenizer(loaded: LoadedModel):
    """The model's tokenizer via transformers, or None if it has none. A GGUF's tokenizer is
    built from the file's metadata read with the gguf package, so that no torch is needed
    (transformers' ``gguf_file=`` route reads the file through torch)."""
    if loaded.tokenizer_dir is None:
        return None
    if loaded.gguf_file:
        path = Path(loaded.tokenizer_dir) / loaded.gguf_file
        try:
            return cached_gguf_tokenizer(path)
        except ImportError:  # a transformers without the GGUF tokenizer mapping used below
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(loaded.tokenizer_dir, gguf_file=loaded.gguf_file)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(loaded.tokenizer_dir)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer(text, add_special_tokens=...)["input_ids"]``, the same ids. For transformers'
    own fast tokenizer class, straight through its Rust backend's ``encode_batch_fast``: no
    offsets computed and the GIL released while it runs (a 200 KB prompt: 45 ms instead of 117,
    and a server's event loop keeps running meanwhile; the backend's ``encode`` would hold the
    GIL throughout). Any other tokenizer, or a backend set to truncate, pad or split special
    tokens (transformers sets those per call), goes through ``tokenizer(...)``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        _plain_fast(type(tokenizer))
        and backend.truncation is None
        and backend.padding is None
        and not backend.encode_special_tokens
        and not getattr(tokenizer, "split_special_tokens", False)
    ):
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


@functools.cache
def _plain_fast(cls: type) -> bool:
    """Whether ``cls`` is transformers' fast tokenizer class, or a subclass that changes none of
    the methods between ``__call__`` and the backend's ``encode_batch``."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast as base
    except ImportError:
        return False
    if not issubclass(cls, base) or not hasattr(Tokenizer, "encode_batch_fast"):
        return False
    names = (
        "__call__",
        "_call_one",
        "_switch_to_input_mode",
        "encode",
        "encode_plus",
        "_encode_plus",
        "_batch_encode_plus",
        "set_truncation_and_padding",
    )
    return all(getattr(cls, n, None) is getattr(base, n, None) for n in names)


def max_chars_per_token(tokenizer) -> int | None:
    """k such that a text of c characters encodes to at least c / k tokens, where the
    tokenizer's parts guarantee one (None where they do not): a BPE model without a fused
    unknown token (every token covers at most its own string, k the longest in the vocabulary
    or among the added tokens, none of which strips the spaces beside it), normalizers that
    drop no character (none, prepend, lowercase, a replacement at least as long as what it
    replaces) and pre-tokenizers that keep every character (byte-level: one per byte;
    metaspace, digits, punctuation, splits that keep the match). A server refuses a prompt
    that cannot fit the context without encoding it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk")):
        return None
    if not (_keeps_chars(spec.get("normalizer")) and _keeps_chars(spec.get("pre_tokenizer"))):
        return None
    added = spec.get("added_tokens") or ()
    if any(t.get("lstrip") or t.get("rstrip") for t in added):  # one takes a run of spaces
        return None
    lengths = [len(t) for t in model.get("vocab") or ()]
    lengths += [len(t["content"]) for t in added]
    return max(lengths, default=0) or None


def _keeps_chars(part: dict | None) -> bool:
    """Whether a normalizer or pre-tokenizer (tokenizer.json's form) leaves at least as many
    characters as it was given."""
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        inner = part.get("normalizers", part.get("pretokenizers"))
        return inner is not None and all(_keeps_chars(p) for p in inner)
    if kind == "Replace":
        pattern = part.get("pattern") or {}
        return "String" in pattern and len(part.get("content", "")) >= len(pattern["String"])
    if kind in ("Split", "Punctuation"):
        return part.get("behavior") != "Removed"
    return kind in ("Prepend", "Lowercase", "ByteLevel", "Metaspace", "Digits")


def cached_gguf_tokenizer(path: Path):
    """``gguf_tokenizer(path)``, converted once and kept as a saved fast tokenizer under
    ``$PAGEDJAX_CACHE_DIR/tokenizers`` (keyed like the parameter cache): the conversion of a
    large vocabulary takes seconds, loading the saved one a fraction of that. The saved one is
    a fast tokenizer, loaded as one: ``AutoTokenizer`` would first import transformers' model
    configuration code and torch (about 1.2 s of a warm ``pagedjax generate``)."""
    from transformers import PreTrainedTokenizerFast

    saved = cache_root() / "tokenizers" / cache_key([path], "tokenizer")
    if (saved / "tokenizer.json").exists():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(saved))
        except Exception:  # a damaged entry: convert again below
            pass
    tokenizer = gguf_tokenizer(str(path))
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=saved.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, saved)  # whole or not at all, if several processes race
            Path(tmp).mkdir()  # for TemporaryDirectory's cleanup
    except OSError:  # a read-only or full cache: the tokenizer works all the same
        pass
    return tokenizer


def gguf_tokenizer(path: str):
    """A fast tokenizer from a GGUF file's tokenizer metadata: transformers' own conversion
    (``convert_gguf_tokenizer``) fed with fields read by the gguf package."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = gguf_reader(path)
    meta = {
        k: f.contents()
        for k, f in reader.fields.items()
        if k.startswith("tokenizer.") or k == "general.architecture"
    }
    grouped = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # as transformers: sentencepiece adds BOS
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
