"""A GGUF file (Llama and Qwen2): its config from the metadata, its tensors dequantized, or a Q8_0
file's linear kernels kept in 8 bits with the file's own block scales (``Q8Blocks``)."""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from .. import quant
from ..config import ModelConfig
from ..weight_maps import KEEP, Transform, WeightMap
from ..weight_maps import T as _T
from .cache import cache_key
from .convert import Q8Blocks, match_name


def unpermute(num_heads_attr: str) -> Transform:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary halves), then transpose."""

    def undo(w: np.ndarray, c: ModelConfig) -> np.ndarray:
        heads = getattr(c, num_heads_attr)
        if w.ndim == 1:  # a bias
            return w.reshape(heads, -1, 2).swapaxes(1, 2).reshape(w.shape)
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape).T

    return undo


def gguf_map(permuted: bool) -> WeightMap:
    q = unpermute("num_heads") if permuted else _T
    k = unpermute("num_kv_heads") if permuted else _T
    qb = unpermute("num_heads") if permuted else KEEP
    kb = unpermute("num_kv_heads") if permuted else KEEP
    single = {
        r"token_embd\.weight": ("embed_tokens/embedding", KEEP),
        r"output_norm\.weight": ("norm/weight", KEEP),
        r"output\.weight": ("lm_head/kernel", _T),
        r"blk\.(\d+)\.attn_q\.weight": ("layers_{0}/self_attn/q_proj/kernel", q),
        r"blk\.(\d+)\.attn_k\.weight": ("layers_{0}/self_attn/k_proj/kernel", k),
        r"blk\.(\d+)\.attn_v\.weight": ("layers_{0}/self_attn/v_proj/kernel", _T),
        r"blk\.(\d+)\.attn_output\.weight": ("layers_{0}/self_attn/o_proj/kernel", _T),
        r"blk\.(\d+)\.attn_q\.bias": ("layers_{0}/self_attn/q_proj/bias", qb),
        r"blk\.(\d+)\.attn_k\.bias": ("layers_{0}/self_attn/k_proj/bias", kb),
        r"blk\.(\d+)\.attn_v\.bias": ("layers_{0}/self_attn/v_proj/bias", KEEP),
        r"blk\.(\d+)\.ffn_gate\.weight": ("layers_{0}/mlp/gate_proj/kernel", _T),
        r"blk\.(\d+)\.ffn_up\.weight": ("layers_{0}/mlp/up_proj/kernel", _T),
        r"blk\.(\d+)\.ffn_down\.weight": ("layers_{0}/mlp/down_proj/kernel", _T),
        r"blk\.(\d+)\.attn_norm\.weight": ("layers_{0}/input_layernorm/weight", KEEP),
        r"blk\.(\d+)\.ffn_norm\.weight": ("layers_{0}/post_attention_layernorm/weight", KEEP),
    }
    return {pattern: [target] for pattern, target in single.items()}


# GGUF architecture -> (HF architecture, are Q/K rows permuted by llama.cpp's converter).
GGUF_ARCHS = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}


def q8_0_blocks(t) -> Q8Blocks:
    """A Q8_0 reader tensor's values and scales, as stored (no arithmetic)."""
    out, n_in = (int(d) for d in reversed(t.shape))  # ggml lists dims innermost first
    blocks = np.asarray(t.data).reshape(-1, 34)  # per block: float16 scale, 32 int8 values
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(out, n_in // 32)
    values = blocks[:, 2:].copy().view(np.int8).reshape(out, n_in)
    return Q8Blocks(values, scales)


def gguf_reader(path: str | Path):
    """The file's parsed reader, one per process for the last file asked for: parsing a GGUF's
    header takes seconds (its vocabulary), and a first load asks three times (kernel types,
    weights, tokenizer). Keyed by the file's path, modification time and size."""
    stat = os.stat(path)
    return _reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        return _fast_reader(GGUFReader)(path)
    except (TypeError, AttributeError):  # a gguf whose reader no longer reads through ``_get``
        return GGUFReader(path)


def _fast_reader(base: type) -> type:
    """gguf's GGUFReader reading its fields and tensor infos from a plain array view of the
    mapped file: the same parse, about 4x faster on a large vocabulary (each of its 200,000
    or so small reads would make a ``np.memmap`` view, whose Python-level bookkeeping is most
    of the time)."""

    class FastReader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count, dtype = int(count), np.dtype(dtype)
            arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(dtype.newbyteorder(order))

    return FastReader


def open_gguf(path: Path, keep_q8_0: bool = False):
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    fields = {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
    }
    arch = fields["general.architecture"]
    if arch not in GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {str(path)!r}; "
            f"supported: {sorted(GGUF_ARCHS)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"GGUF {str(path)!r} uses per-frequency rope factors (rope_freqs), "
            "which this loader does not support yet"
        )
    vocab = fields.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf = {
        "architectures": [GGUF_ARCHS[arch][0]],
        "vocab_size": vocab,
        "hidden_size": fields[f"{arch}.embedding_length"],
        "intermediate_size": fields[f"{arch}.feed_forward_length"],
        "num_hidden_layers": fields[f"{arch}.block_count"],
        "num_attention_heads": fields[f"{arch}.attention.head_count"],
        "num_key_value_heads": fields.get(f"{arch}.attention.head_count_kv"),
        "rms_norm_eps": fields[f"{arch}.attention.layer_norm_rms_epsilon"],
        "rope_theta": fields.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": fields.get(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": reader.fields["tokenizer.ggml.bos_token_id"].contents()
        if "tokenizer.ggml.bos_token_id" in reader.fields
        else None,
        "eos_token_id": reader.fields["tokenizer.ggml.eos_token_id"].contents()
        if "tokenizer.ggml.eos_token_id" in reader.fields
        else None,
    }
    if fields.get(f"{arch}.rope.scaling.type") == "linear":
        hf["rope_scaling"] = {
            "rope_type": "linear",
            "factor": fields[f"{arch}.rope.scaling.factor"],
        }
    config = ModelConfig.from_hf_dict(hf)

    permuted = GGUF_ARCHS[arch][1]
    patterns = [(re.compile(k), v) for k, v in gguf_map(permuted).items()]

    def is_kernel(name: str) -> bool:
        return any(ours.endswith("/kernel") for ours, _ in match_name(name, patterns) or [])

    def tensors():
        for t in reader.tensors:
            if keep_q8_0 and t.tensor_type.name == "Q8_0" and is_kernel(t.name):
                yield t.name, q8_0_blocks(t)
                continue
            shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims innermost first
            yield t.name, dequantize(t.data, t.tensor_type).reshape(shape)

    return config, tensors, gguf_map(permuted)


def gguf_kernel_types(reader, permuted: bool) -> set[str]:
    """The GGUF types (e.g. "Q8_0") of the tensors that map to linear kernels."""
    patterns = [(re.compile(k), v) for k, v in gguf_map(permuted).items()]
    types = set()
    for t in reader.tensors:
        targets = match_name(t.name, patterns) or []
        if any(ours.endswith("/kernel") for ours, _ in targets):
            types.add(t.tensor_type.name)
    return types


def cached_gguf_kernel_types(path: Path, cache_root: Path) -> set[str]:
    """``gguf_kernel_types`` of the file, kept under ``cache_root/gguf`` (keyed like the
    parameter cache): reading a GGUF's header takes seconds (its vocabulary), and every load of
    the file asks, a cached one too. Empty for an architecture this loader does not know."""
    saved = cache_root / "gguf" / f"{cache_key([path], 'kernel-types')}.json"
    try:
        return set(json.loads(saved.read_text()))
    except (OSError, ValueError):
        pass
    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    types = gguf_kernel_types(reader, GGUF_ARCHS[arch][1]) if arch in GGUF_ARCHS else set()
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=saved.parent, delete=False) as f:
            json.dump(sorted(types), f)
        os.replace(f.name, saved)
    except OSError:  # a read-only or full cache: asked again next time
        pass
    return types


def keeps_q8_0(path: Path, quantization: str | None, cache_root: Path) -> bool:
    """Whether the GGUF at ``path`` loads its linear kernels as int8 with the file's scales:
    every one of them is Q8_0 (mixed or other files dequantize) and ``quantization`` is None or
    that layout; any other method on such a file is refused (a second rounding)."""
    if cached_gguf_kernel_types(path, cache_root) != {"Q8_0"}:
        return False  # an unsupported architecture is reported by open_gguf
    if quantization not in (None, quant.GGUF_Q8_0):
        raise ValueError(
            f"{str(path)!r} is a Q8_0 GGUF: its linear kernels load as int8 with the file's own "
            f"scales per 32 inputs (quantization=None or {quant.GGUF_Q8_0!r}); "
            f"quantization={quantization!r} would round them a second time"
        )
    return True
