"""One command that proves and times pagedjax on a GPU: run it first whenever a GPU is at hand.

Stages, each guarded (a failure is recorded with its traceback and the next stage still runs) and
each with its own time budget (stages 1-5 are sized for 8 minutes on one H200, stage 6 for about
150 s more; --budget-scale 0.8 fits the whole run in 10 minutes, and --stages runs a part of it):

  1 env       jax/jaxlib/torch/transformers versions, backend, device kind, memory, the Pallas
              GPU lowerings this JAX offers (Triton; Mosaic GPU) and the ops it ships
  2 kernels   decode and ragged paged attention on the device against the float32 reference:
              float32 and bfloat16, GQA 1/4/8, block sizes 16/32, NaN in every stale slot and in
              the null block, padding query rows NaN; through ``backend="gpu"`` and JAX's shipped
              ``jax.experimental.pallas.ops.gpu.paged_attention``; which lowering each ran (read
              from the lowered program) and every warning raised
  3 engine    (a) a tiny random Llama through ``LLM.generate``, greedy tokens equal to transformers
              on the same device, with a pool small enough to preempt (recompute, then swap) and
              a shared prompt prefix (prefix caching); (b) a Llama-3-8B-shaped random-weight
              model in bfloat16, built on the device (no download, no files; all 32 layers unless
              --big-layers says fewer) through ``LLM.generate`` on a ShareGPT-like workload:
              output tokens/s (warm), cold run, seconds per compiled program, KV blocks, peak
              device memory
  4 decode    benchmarks/paged_attention_gpu.py at reduced size: achieved bandwidth as a fraction
              of a device copy measured in the same run, ratio to JAX's shipped op
  5 peer      the stage-3b workload through transformers (PyTorch) on the same device, batch
              sweep, best batch size against pagedjax
  6 serve     online serving over HTTP: ``pagedjax bench serve`` against ``pagedjax serve`` and
              ``transformers serve --continuous-batching`` on the same GPU, one at a time, on a
              Llama-3.2-1B-shaped random-weight model (bfloat16, built on the device, a word-level
              tokenizer, no EOS: exact output lengths on both sides), random 256-token prompts,
              128-token outputs, concurrency 1/16/64: output tok/s, TTFT, TPOT per concurrency and
              the pagedjax / transformers ratios

Prints one summary table at the end (and each stage's lines as it goes); writes
``device_check.json`` (after every stage) and ``device_check.log`` under --out.

    python3 benchmarks/device_check.py --out device_check_out      # on a GPU (make device-check)
    python3 benchmarks/device_check.py --toy --out /tmp/dc          # CPU: toy sizes, interpret mode

No install is needed: the script puts the repository on sys.path (for a checkout that is not
installed, through a temporary tree of links that lays out ``pagedjax.models`` and
``pagedjax.pallas_kernels`` as an install does), so it runs on a machine's Python as it is (jax
with CUDA, torch, transformers, flax, orbax), without network. Stage 6 also needs the HTTP
packages, which a bare GPU image may lack (fastapi, starlette, pydantic, uvicorn; httpx2 for the
client; openai for transformers serve): ``make wheelhouse`` downloads their wheels (Python 3.12,
manylinux x86-64) into ``wheelhouse/`` (ignored by git), copied beside the checkout on a machine
without an index, and stage 6 installs them from there into a temporary directory
(``pip install --no-index --no-deps --target``). Without them stage 6 is skipped with the names
of what is missing; without a ``transformers`` executable (or its serving packages) it measures
pagedjax alone.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import importlib
import itertools
import json
import os
import pkgutil
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

# JAX and torch share the GPU in one process: JAX takes half up front, torch (3a, 5) the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


for _p in (ROOT, ROOT / "benchmarks"):  # run from anywhere, nothing installed
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def installed_layout() -> bool:
    """Whether ``import pagedjax.pallas_kernels`` works here as things stand: pagedjax installed
    (pallas_kernels/ inside the package, or an editable install's finder mapping it)."""
    import importlib.machinery
    import importlib.util

    spec = importlib.util.find_spec("pagedjax")  # a top-level spec: nothing is executed
    if spec is None or spec.origin is None:
        return False
    if (Path(spec.origin).parent / "pallas_kernels").is_dir():
        return True
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        with contextlib.suppress(Exception):
            if finder.find_spec("pagedjax.pallas_kernels", None) is not None:
                return True
    return False


def source_tree() -> Path | None:
    """For a checkout that is not installed: a temporary directory holding ``pagedjax/`` as an
    install lays it out (links to each entry of pagedjax/, plus models/ and pallas_kernels/,
    which pyproject's package-dir maps to pagedjax.models and pagedjax.pallas_kernels), put
    first on sys.path; None when pagedjax is installed."""
    if installed_layout():
        return None
    tree = Path(tempfile.mkdtemp(prefix="pagedjax-source-"))
    atexit.register(shutil.rmtree, tree, True)  # the links only: rmtree follows none
    (tree / "pagedjax").mkdir()
    for child in (ROOT / "pagedjax").iterdir():
        if child.name != "__pycache__":
            (tree / "pagedjax" / child.name).symlink_to(child)
    for name in ("models", "pallas_kernels"):
        (tree / "pagedjax" / name).symlink_to(ROOT / name)
    sys.path.insert(0, str(tree))
    # Imported now, so that it stays the package even after a module that puts the checkout
    # itself first on sys.path (benchmarks/paged_attention_gpu.py does).
    importlib.import_module("pagedjax")
    return tree


SOURCE_TREE = source_tree()

import paged_attention_gpu as decode_bench  # noqa: E402
from pagedjax.pallas_kernels import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

TOLERANCE = {"float32": 1e-4, "bfloat16": 1.5e-2}  # max |out - ref| / max |ref|
GQA_HEADS = {1: (2, 2), 4: (8, 2), 8: (16, 2)}  # GQA ratio -> (num_heads, num_kv_heads)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# Llama-3-8B's config.json, as transformers reads it (weights are random; nothing is downloaded).
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
# The same family at toy size (CPU smoke run).
TOY_LLAMA = dict(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_scaling=dict(LLAMA3_8B["rope_scaling"], original_max_position_embeddings=256),
    bos_token_id=1,
    eos_token_id=2,
)
# Stage 6's model: Llama-3.2-1B's shape with a 32000-word vocabulary (random weights, built on
# the device: no weights can be downloaded there, and the word tokenizer needs none).
SERVE_LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
)
SERVE_TOY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
)


@dataclasses.dataclass(frozen=True)
class ServeSizes:
    """Stage 6: the workload of ``pagedjax bench serve`` and the servers' settings."""

    model: dict  # transformers.LlamaConfig fields (random weights)
    dtype: str
    input_len: int
    output_len: int
    concurrency: tuple[int, ...]
    num_prompts: tuple[int, ...]  # per concurrency: the workload's first ones
    max_model_len: int
    max_num_seqs: int
    num_blocks: int  # pagedjax's pool, explicit: the same on every run, whatever memory is free
    peers: tuple[str, ...]  # started after pagedjax, if installed
    pagedjax_args: tuple[str, ...] = ()
    server_timeout_s: float = 120.0  # to /health (pagedjax compiles its step programs first)
    request_timeout_s: float = 60.0  # for each next byte: a stalled server cannot hang the stage


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything that differs between the device run and the toy (CPU) run."""

    # stage 2: one case = num_seqs sequences, contexts up to max_context tokens
    head_dim: int
    kernel_seqs: int
    kernel_max_context: int
    full_matrix: bool  # every (kind, dtype, GQA, block size); else a covering subset
    # stage 3a
    tiny_new_tokens: int
    tiny_preemption_modes: tuple[str, ...]
    # stage 3b / 5
    big_config: dict
    big_layers: int
    num_requests: int
    max_prompt_len: int
    max_output_len: int
    max_num_seqs: int
    kv_cache_space_gib: float
    # stage 4: arguments of benchmarks/paged_attention_gpu.py
    bench_argv: tuple[str, ...]
    # stage 5
    hf_batch_sizes: tuple[int, ...]
    # stage 6
    serve: ServeSizes
    # seconds per stage (soft: checked between steps; a stage is stopped at 1.5x + 30 s)
    budgets: dict


DEVICE = Sizes(
    head_dim=128,
    kernel_seqs=8,
    kernel_max_context=768,
    full_matrix=True,
    tiny_new_tokens=24,
    tiny_preemption_modes=("recompute", "swap"),
    big_config=LLAMA3_8B,
    big_layers=32,  # the whole depth: layers run under scan, so compile time does not grow with it
    num_requests=128,
    max_prompt_len=512,
    max_output_len=256,
    max_num_seqs=64,  # fewer decode buckets: fewer programs to compile in the cold run
    kv_cache_space_gib=16.0,
    bench_argv=("--batches", "8", "64", "--contexts", "2048", "16384"),
    hf_batch_sizes=(128, 64, 32),
    serve=ServeSizes(
        model=SERVE_LLAMA_1B,
        dtype="bfloat16",
        input_len=256,
        output_len=128,
        concurrency=(1, 16, 64),
        num_prompts=(4, 32, 64),
        max_model_len=512,
        max_num_seqs=64,
        num_blocks=2560,  # 64 sequences of 512 tokens need 2048 blocks of 16 (640 MiB in all)
        peers=("transformers",),
    ),
    budgets={
        "env": 15,
        "kernels": 90,
        "engine_tiny": 60,
        "engine_8b": 150,
        "decode": 60,
        "peer": 75,
        "serve": 150,
    },
)
TOY = Sizes(
    head_dim=32,
    kernel_seqs=3,
    kernel_max_context=64,
    full_matrix=False,
    tiny_new_tokens=12,
    tiny_preemption_modes=("recompute",),
    big_config=TOY_LLAMA,
    big_layers=2,
    num_requests=4,
    max_prompt_len=32,
    max_output_len=8,
    max_num_seqs=8,  # every request in one prefill step: few programs to compile
    kv_cache_space_gib=0.01,
    bench_argv=("--interpret", "--small", "--batches", "3", "--skip-jax"),  # JAX op: stage 2
    hf_batch_sizes=(4,),
    serve=ServeSizes(
        model=SERVE_TOY,
        dtype="float32",
        input_len=12,
        output_len=6,
        concurrency=(1, 2),
        num_prompts=(2, 4),
        max_model_len=64,
        max_num_seqs=4,
        num_blocks=64,
        peers=(),  # pagedjax alone: transformers serve takes a minute to start on this CPU
        pagedjax_args=("--no-warmup",),
        server_timeout_s=180.0,
    ),
    budgets={
        "env": 60,
        "kernels": 240,
        "engine_tiny": 240,
        "engine_8b": 240,
        "decode": 240,
        "peer": 240,
        "serve": 240,
    },
)


# ---- running stages ---------------------------------------------------------------------------


class StageTimeout(BaseException):
    """Raised in the main thread when a stage overruns its hard limit (BaseException, so that
    no ``except Exception`` inside the stage swallows it)."""


class BudgetSpent(Exception):
    """A stage's soft budget is spent: it stops early and reports what it has (PARTIAL)."""


class StageSkipped(Exception):
    """The stage does not apply here (e.g. a GPU-only comparison on a TPU)."""


HARD_FACTOR, HARD_SLACK_S = 1.5, 30.0


@dataclasses.dataclass
class Budget:
    seconds: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise BudgetSpent(f"budget of {self.seconds:.0f} s spent before {what}")


@dataclasses.dataclass
class StageResult:
    key: str
    title: str
    status: str = "SKIP"  # PASS | FAIL (a check failed) | ERROR | PARTIAL (budget) | SKIP
    seconds: float = 0.0
    summary: str = ""
    data: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    warnings: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Context:
    sizes: Sizes
    platform: str  # jax.default_backend(): "gpu", "tpu" or "cpu"
    interpret: bool  # run the Pallas kernels interpreted (toy run)
    out: Path
    command: str = ""
    results: dict = dataclasses.field(default_factory=dict)  # key -> StageResult

    @property
    def kernel_backend(self) -> str:
        return "tpu" if self.platform == "tpu" else "gpu"

    @property
    def torch_device(self) -> str:
        import torch

        return "cuda" if self.platform == "gpu" and torch.cuda.is_available() else "cpu"


def say(*parts) -> None:
    print(*parts, flush=True)


@contextlib.contextmanager
def hard_limit(seconds: float, key: str):
    """SIGALRM after ``seconds`` raises StageTimeout in the main thread (POSIX only)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise StageTimeout(f"stage {key} stopped at its hard limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_stage(ctx: Context, key: str, title: str, fn, budget_s: float) -> StageResult:
    """Run one stage: fn(ctx, budget, data) -> (ok, summary). Records, never raises, a failure."""
    result = StageResult(key, title)
    ctx.results[key] = result
    say(f"\n== {key}: {title} (budget {budget_s:.0f} s) ==")
    budget = Budget(budget_s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with hard_limit(budget_s * HARD_FACTOR + HARD_SLACK_S, key):
                ok, result.summary = fn(ctx, budget, result.data)
            result.status = "PASS" if ok else "FAIL"
        except StageSkipped as e:
            result.status, result.summary = "SKIP", str(e)
        except BudgetSpent as e:
            result.status, result.summary = "PARTIAL", f"{e}; " + summary_of_partial(result.data)
        except (Exception, StageTimeout) as e:
            result.status = "ERROR"
            result.error = traceback.format_exc()
            result.summary = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            say(result.error)
    result.seconds = budget.seconds - budget.left()
    result.warnings = unique_warnings(caught)
    for w in result.warnings:
        say(f"warning: {w}")
    say(f"-> {result.status} in {result.seconds:.1f} s: {result.summary}")
    write_json(ctx)
    return result


def summary_of_partial(data: dict) -> str:
    return data.get("partial", "results so far in the JSON")


def unique_warnings(caught) -> list[str]:
    seen: dict[str, None] = {}
    for w in caught:
        text = f"{w.category.__name__}: {str(w.message).strip()}"
        seen.setdefault(text[:400], None)
    return list(seen)


def write_json(ctx: Context) -> None:
    payload = {
        "command": ctx.command,
        "sizes": dataclasses.asdict(ctx.sizes),
        "interpret": ctx.interpret,
        "stages": {k: dataclasses.asdict(r) for k, r in ctx.results.items()},
    }
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "device_check.json").write_text(json.dumps(payload, indent=2, default=str))


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| in float32; inf if ``out`` holds NaN or inf."""
    return decode_bench.rel_err(jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32))


def note_lowering(ctx: Context, lowerings: dict, name: str, jitted, *args, **kw) -> None:
    """Record once per op which Pallas lowering ``jitted(*args, **kw)`` (not interpreted) takes
    for the device; in an interpreted run, lowered for the device without running."""
    if name in lowerings:
        return
    target = "tpu" if ctx.kernel_backend == "tpu" else "cuda"
    lowered = jitted.trace(*args, **kw).lower(lowering_platforms=(target,))
    found = lowering_of(lowered.as_text())
    lowerings[name] = f"interpret here; lowers to {found} for {target}" if ctx.interpret else found


def lowering_of(lowered_text: str) -> str:
    """Which Pallas lowering a lowered program used, read from its custom calls."""
    found = [
        name
        for name, marker in (
            ("triton", "xla.gpu.triton"),
            ("triton", "triton_kernel_call"),
            ("mosaic_gpu", "mosaic_gpu"),
            ("mosaic_tpu", "tpu_custom_call"),
        )
        if marker in lowered_text
    ]
    return "+".join(dict.fromkeys(found)) or "none (plain XLA)"


# ---- stage 1: environment ---------------------------------------------------------------------


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # absent or broken: say so in the table rather than stop
        return None


def compilation_cache_dir():
    """Where pagedjax keeps compiled programs (None: off); older checkouts had no such cache."""
    try:
        return importlib.import_module("pagedjax.compilation").cache_dir()
    except ImportError:
        return None


def stage_env(ctx: Context, budget: Budget, data: dict):
    import jaxlib

    dev = jax.devices()[0]
    data.update(
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        devices=[f"{d.platform}:{d.device_kind}" for d in jax.devices()],
        device_kind=dev.device_kind,
        platform_version=getattr(dev.client, "platform_version", None),
        torch=_version("torch"),
        transformers=_version("transformers"),
        triton=_version("triton"),
        flax=_version("flax"),
        interpret=ctx.interpret,
    )
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats:
        data["memory_bytes_limit"] = stats.get("bytes_limit")
        data["memory_bytes_in_use"] = stats.get("bytes_in_use")
    try:
        import torch

        data["torch_cuda"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            data["torch_cuda_device"] = torch.cuda.get_device_name(0)
            data["torch_cuda_mem_total"] = total
    except Exception as e:  # torch missing or broken: stages 3a/5 will say more
        data["torch_cuda"] = f"{type(e).__name__}: {e}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        data["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=15,
        ).stdout.strip()
    lowerings = {}
    for name in ("triton", "mosaic_gpu", "tpu"):
        try:
            importlib.import_module(f"jax.experimental.pallas.{name}")
            lowerings[name] = "importable"
        except Exception as e:  # a lowering this JAX lacks
            lowerings[name] = f"{type(e).__name__}: {e}"
    data["pallas_lowerings"] = lowerings
    data["jax_pallas_use_mosaic_gpu"] = getattr(jax.config, "jax_pallas_use_mosaic_gpu", None)
    cache = jax.config.jax_compilation_cache_dir or str(compilation_cache_dir())
    entries = len(list(Path(cache).iterdir())) if cache and Path(cache).is_dir() else 0
    data["jax_compilation_cache"] = f"{cache} ({entries} entries at start)"
    data["pagedjax_gpu_lowering"] = getattr(
        importlib.import_module("pagedjax.pallas_kernels._gpu"), "GPU_LOWERING", None
    )
    try:
        import jax.experimental.pallas.ops.gpu as jax_gpu_ops

        data["jax_gpu_ops"] = sorted(m.name for m in pkgutil.iter_modules(jax_gpu_ops.__path__))
    except Exception as e:  # no GPU ops in this JAX
        data["jax_gpu_ops"] = f"{type(e).__name__}: {e}"
    for k, v in data.items():
        say(f"  {k}: {v}")
    mem = data.get("memory_bytes_limit")
    summary = (
        f"jax {data['jax']} on {data['backend']}, {data['device_kind']}"
        + (f", JAX limit {mem / 2**30:.1f} GiB" if mem else "")
        + f"; torch {data['torch']} (cuda: {data.get('torch_cuda')}), "
        f"transformers {data['transformers']}"
    )
    return True, summary


# ---- stage 2: kernel correctness --------------------------------------------------------------


def kernel_matrix(full: bool) -> list[tuple[str, str, int, int]]:
    """(kind, dtype, GQA ratio, block size): the full grid, or a subset covering every value."""
    if full:
        return list(
            itertools.product(("decode", "ragged"), ("float32", "bfloat16"), (1, 4, 8), (16, 32))
        )
    return [
        ("decode", "float32", 1, 16),
        ("decode", "bfloat16", 8, 32),
        ("ragged", "bfloat16", 4, 32),
    ]


def context_lengths(rng, num_seqs: int, block_size: int, max_context: int) -> np.ndarray:
    """Lengths ending on and off block boundaries (1, a full block, one past, one short), the
    longest filling all but the last block, the rest random."""
    top = max_context - block_size
    fixed = [top, 1, block_size, block_size + 1, 2 * block_size - 1]
    rand = rng.integers(1, top + 1, max(num_seqs - len(fixed), 0)).tolist()
    return np.asarray((fixed + rand)[:num_seqs], np.int32)


def build_pool(ctx: Context, rng, key, *, dtype, num_kv_heads, block_size, lens):
    """Random K/V pages, block tables into blocks 1.. (padding columns 0), and the same pool with
    NaN in every stale slot and in the null block."""
    s = ctx.sizes
    pages = s.kernel_max_context // block_size
    num_blocks = 1 + len(lens) * pages
    shape = argparse.Namespace(
        num_kv_heads=num_kv_heads, block_size=block_size, head_dim=s.head_dim
    )
    k, v = decode_bench.make_pool(key, shape, num_blocks, jnp.dtype(dtype))
    table = (rng.permutation(num_blocks - 1)[: len(lens) * pages] + 1).reshape(len(lens), pages)
    used = -(-lens // block_size)
    table = np.where(np.arange(pages)[None, :] < used[:, None], table, 0).astype(np.int32)
    table, lens = jnp.asarray(table), jnp.asarray(lens)
    poisoned = (
        decode_bench.poison_stale_slots(k, table, lens),
        decode_bench.poison_stale_slots(v, table, lens),
    )
    return (k, v), poisoned, table, lens


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


@functools.partial(jax.jit, static_argnames=("scale",))
def _decode_ref(q, k, v, table, lens, *, scale):
    return paged_attention_reference(*_f32(q, k, v), table, lens, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale", "max_query_len"))
def _ragged_ref(q, k, v, table, lens, qsl, *, scale, max_query_len):
    return ragged_paged_attention_reference(
        *_f32(q, k, v), table, lens, qsl, scale=scale, max_query_len=max_query_len
    )


def decode_case(ctx, rng, key, dtype, ratio, block_size):
    heads, kv_heads = GQA_HEADS[ratio]
    lens = context_lengths(rng, ctx.sizes.kernel_seqs, block_size, ctx.sizes.kernel_max_context)
    finite, poisoned, table, lens = build_pool(
        ctx, rng, key, dtype=dtype, num_kv_heads=kv_heads, block_size=block_size, lens=lens
    )
    q = jnp.asarray(rng.standard_normal((len(lens), heads, ctx.sizes.head_dim)), dtype)
    return q, finite, poisoned, table, lens


def ragged_case(ctx, rng, key, dtype, ratio, block_size):
    """Prefill, chunked prefill and decode rows in one packed batch, then NaN padding rows."""
    heads, kv_heads = GQA_HEADS[ratio]
    lens = context_lengths(rng, ctx.sizes.kernel_seqs, block_size, ctx.sizes.kernel_max_context)
    q_lens = np.array(
        [[n, min(n, 37), 1][i % 3] for i, n in enumerate(lens.tolist())], np.int32
    )  # whole prompt / a chunk / one token
    finite, poisoned, table, lens = build_pool(
        ctx, rng, key, dtype=dtype, num_kv_heads=kv_heads, block_size=block_size, lens=lens
    )
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pad_rows = 5
    q = rng.standard_normal((int(qsl[-1]) + pad_rows, heads, ctx.sizes.head_dim))
    q[qsl[-1] :] = np.nan
    return jnp.asarray(q, dtype), finite, poisoned, table, lens, jnp.asarray(qsl), int(q_lens.max())


def stage_kernels(ctx: Context, budget: Budget, data: dict):
    backend, interpret = ctx.kernel_backend, ctx.interpret
    cases = data.setdefault("cases", [])
    lowerings = data.setdefault("lowering", {})
    say(
        f"  backend={backend} interpret={interpret} head_dim={ctx.sizes.head_dim} "
        f"seqs={ctx.sizes.kernel_seqs} max_context={ctx.sizes.kernel_max_context}"
    )
    say("  | op | kind | dtype | GQA | block | rel err | tol | stale NaN -> finite | ok |")
    rng = np.random.default_rng(0)
    matrix = kernel_matrix(ctx.sizes.full_matrix)
    for n, (kind, dtype, ratio, bs) in enumerate(matrix):
        if budget.left() <= 0:
            data["partial"] = f"{n} of {len(matrix)} kernel cases run"
            budget.check(f"kernel case {n + 1} of {len(matrix)}")
        case = dict(kind=kind, dtype=dtype, gqa=ratio, block_size=bs, tol=TOLERANCE[dtype])
        check = check_decode if kind == "decode" else check_ragged
        arrays = guarded(cases, dict(case, op="ours"), check, ctx, rng, n, lowerings)
        if kind == "decode" and backend == "gpu" and arrays is not None:
            guarded(cases, dict(case, op="jax"), check_jax_op, ctx, arrays, lowerings)
    ours = [c for c in cases if c["op"] == "ours"]
    jax_rows = [c for c in cases if c["op"] == "jax"]
    worst = {
        dt: max((c["rel_err"] for c in ours if c["dtype"] == dt and "rel_err" in c), default=None)
        for dt in ("float32", "bfloat16")
    }
    data["max_rel_err"] = worst
    data["mosaic_gpu"] = (
        "not run: pallas_kernels has no Mosaic GPU variant and JAX ships no Mosaic GPU paged "
        "attention (its ops/gpu *_mgpu modules are matmul/attention/collectives)"
    )
    summary = (
        f"ours {sum(c['ok'] for c in ours)}/{len(ours)} within tol (max err f32 "
        f"{_e(worst['float32'])}, bf16 {_e(worst['bfloat16'])}); lowering {lowerings}"
    )
    if jax_rows:
        summary += (
            f"; JAX op on finite pools: {sum(c['ok'] for c in jax_rows)}/{len(jax_rows)} "
            f"within tol, finite with stale NaN: "
            f"{sum(c.get('stale_nan_finite', False) for c in jax_rows)}/{len(jax_rows)}"
        )
    return all(c["ok"] for c in ours), summary


def guarded(cases: list, row: dict, check, *args):
    """Run one case's check, which fills ``row``; an exception fails that case only."""
    cases.append(row)
    try:
        result = check(row, *args)
    except Exception as e:
        row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        say(
            f"  | {row['op']} | {row['kind']} | {row['dtype']} | {row['gqa']} | "
            f"{row['block_size']} | {type(e).__name__}: {str(e)[:200]} |"
        )
        return None
    finite = row.get("finite", row.get("stale_nan_finite"))
    say(
        f"  | {row['op']} | {row['kind']} | {row['dtype']} | {row['gqa']} | {row['block_size']} "
        f"| {row['rel_err']:.1e} | {row['tol']:g} | {finite} | {row['ok']} |"
    )
    return result


def check_decode(row: dict, ctx: Context, rng, n: int, lowerings: dict):
    """Our decode kernel on the poisoned pool vs the reference on the finite one."""
    q, finite, poisoned, table, lens = decode_case(
        ctx, rng, jax.random.key(n), row["dtype"], row["gqa"], row["block_size"]
    )
    scale = ctx.sizes.head_dim**-0.5
    kwargs = dict(scale=scale, backend=ctx.kernel_backend, interpret=ctx.interpret)
    out = paged_attention(q, *poisoned, table, lens, **kwargs)
    ref = _decode_ref(q, *finite, table, lens, scale=scale)
    args = (q, *poisoned, table, lens)
    compiled = dict(kwargs, interpret=False)  # what runs on the device
    note_lowering(ctx, lowerings, "ours/decode", paged_attention, *args, **compiled)
    err = rel_err(out, ref)
    row.update(rel_err=err, finite=bool(np.isfinite(err)), ok=bool(err <= row["tol"]))
    return q, finite, poisoned, table, lens, ref


def check_ragged(row: dict, ctx: Context, rng, n: int, lowerings: dict):
    """Our ragged kernel on the poisoned pool vs the reference; NaN padding rows must be 0."""
    q, finite, poisoned, table, lens, qsl, max_q = ragged_case(
        ctx, rng, jax.random.key(n), row["dtype"], row["gqa"], row["block_size"]
    )
    scale = ctx.sizes.head_dim**-0.5
    kwargs = dict(
        scale=scale, max_query_len=max_q, backend=ctx.kernel_backend, interpret=ctx.interpret
    )
    out = ragged_paged_attention(q, *poisoned, table, lens, qsl, **kwargs)
    ref = _ragged_ref(q, *finite, table, lens, qsl, scale=scale, max_query_len=max_q)
    args = (q, *poisoned, table, lens, qsl)
    compiled = dict(kwargs, interpret=False)
    note_lowering(ctx, lowerings, "ours/ragged", ragged_paged_attention, *args, **compiled)
    err = rel_err(out, ref)
    tail = np.asarray(jnp.asarray(out[int(qsl[-1]) :], jnp.float32))
    pad_ok = bool(np.all(tail == 0))
    row.update(rel_err=err, finite=bool(np.isfinite(err)), padding_rows_zero=pad_ok)
    row["ok"] = bool(err <= row["tol"] and pad_ok)
    return None


def check_jax_op(row: dict, ctx: Context, arrays, lowerings: dict):
    """JAX's shipped GPU op (queries pre-scaled: it applies no scale) on the finite pool, and on
    the poisoned one for whether NaN stays out. A finding about JAX's op, not a failure of ours."""
    q, finite, poisoned, table, lens, ref = arrays
    op = decode_bench.jax_shipped_op(ctx.interpret, table.shape[1])
    qs = (q * ctx.sizes.head_dim**-0.5).astype(q.dtype)
    err = rel_err(op(qs, *finite, table, lens), ref)
    row.update(
        rel_err=err,
        stale_nan_finite=bool(jnp.isfinite(op(qs, *poisoned, table, lens)).all()),
        ok=bool(err <= row["tol"]),
    )
    compiled = decode_bench.jax_shipped_op(False, table.shape[1])
    note_lowering(ctx, lowerings, "jax_op/decode", compiled, qs, *finite, table, lens)


def _e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


# ---- stage 3: engine end to end ---------------------------------------------------------------


def tiny_hf_model(directory: Path, device: str):
    """A tiny random Llama (GQA), saved with save_pretrained; returns the torch model."""
    from pagedjax.bench.tiny import tiny_llama

    model = tiny_llama(directory)
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos does
    return model.to(device)


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    import torch

    outs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding in the oracle
            ids = torch.tensor([p], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def stage_engine_tiny(ctx: Context, budget: Budget, data: dict):
    import torch

    from pagedjax import LLM, SamplingParams

    device = ctx.torch_device
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle in true float32
    new = ctx.sizes.tiny_new_tokens
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 256, 32).tolist()  # two full blocks shared by every prompt
    prompts = [prefix + rng.integers(3, 256, n).tolist() for n in (3, 9, 17, 1, 12, 25)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        hf = tiny_hf_model(model_dir, device)
        expected = hf_greedy(hf, prompts, new, device)
        del hf
        data["oracle"] = f"transformers {device} float32, one prompt at a time"
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        runs = []
        # Pool of 11 usable blocks for 6 sequences of up to 5 blocks: preemption must happen.
        for mode in ctx.sizes.tiny_preemption_modes:
            # XLA on a GPU may use TF32 for float32 matmuls; the comparison wants float32.
            with jax.default_matmul_precision("highest"):
                llm = LLM(
                    str(model_dir),
                    dtype="float32",
                    block_size=16,
                    num_blocks=12,
                    max_model_len=96,
                    max_num_seqs=8,
                    enable_prefix_caching=True,
                    preemption_mode=mode,
                    swap_space_gib=0.01,
                    cache_dir=str(Path(tmp) / "cache"),
                )
                try:
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    stats = llm.get_stats()
                finally:
                    llm.close()
            got = [list(o.outputs[0].token_ids) for o in outs]
            diffs = [first_difference(g, e) for g, e in zip(got, expected, strict=True)]
            run = dict(
                preemption_mode=mode,
                equal=sum(d is None for d in diffs),
                prompts=len(prompts),
                first_difference=diffs,
                num_preemptions=stats.num_preemptions,
                num_swapped_out=stats.num_swapped_out,
                prefix_cache_hits=stats.prefix_cache_hits,
                prefix_cache_queries=stats.prefix_cache_queries,
                num_compilations=stats.num_compilations,
            )
            run["ok"] = bool(
                run["equal"] == len(prompts)
                and stats.num_preemptions > 0
                and stats.prefix_cache_hits > 0
                and (mode != "swap" or stats.num_swapped_out > 0)
            )
            runs.append(run)
            say(f"  tiny Llama, preemption={mode}: {run}")
    data["runs"] = runs
    ok = all(r["ok"] for r in runs)
    summary = "tiny: " + ", ".join(
        f"{r['preemption_mode']} {r['equal']}/{r['prompts']} = HF ({r['num_preemptions']} "
        f"preempted, {r['prefix_cache_hits']} prefix hits)"
        for r in runs
    )
    return ok, summary


def random_params(config, dtype: str, seed: int = 0):
    """Random weights on the default device with the model's parameter tree (no host copy):
    norms 1, biases 0, matrices N(0, 0.02)."""
    from pagedjax.models.llama import param_shapes

    shapes = param_shapes(config, dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(flat))

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def init(key, shape, dtype, kind):
        if kind == "norm":
            return jnp.ones(shape, dtype)
        if kind == "bias":
            return jnp.zeros(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, dtype)).astype(dtype)  # no float32 copy

    leaves = []
    for key, (path, s) in zip(keys, flat, strict=True):
        name = jax.tree_util.keystr(path)
        kind = "norm" if "norm" in name else "bias" if "bias" in name else "matrix"
        leaves.append(init(key, s.shape, s.dtype, kind))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def llm_with_weights(loaded, **kwargs):
    """An ``LLM`` over in-memory weights: LLM only takes a path, so its loader is replaced by one
    returning ``loaded`` for the duration of the constructor."""
    from pagedjax import LLM

    module = sys.modules[LLM.__module__]
    if not hasattr(module, "load_model"):
        raise RuntimeError(f"{module.__name__} has no load_model to hand in-memory weights to LLM")
    original = module.load_model
    module.load_model = lambda *a, **k: loaded
    try:
        return LLM(loaded.source, **kwargs)
    finally:
        module.load_model = original


def big_hf_config(ctx: Context):
    import transformers

    hf = dict(ctx.sizes.big_config, num_hidden_layers=ctx.sizes.big_layers)
    return transformers.LlamaConfig(**hf)


def big_workload(ctx: Context, vocab_size: int, seed: int):
    from pagedjax.bench.throughput_sides import synthetic_requests

    s = ctx.sizes
    return synthetic_requests(
        s.num_requests,
        vocab_size=vocab_size,
        max_prompt_len=s.max_prompt_len,
        max_output_len=s.max_output_len,
        seed=seed,
    )


@contextlib.contextmanager
def compile_events():
    """Collect (function name, seconds) of every XLA compilation while the block runs."""
    events: list[tuple[str, float]] = []

    def listen(event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            events.append((str(kw.get("fun_name", "?")), float(duration)))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        with contextlib.suppress(Exception):  # older JAX: no unregister
            jax.monitoring.unregister_event_duration_listener(listen)


TOY_NOTE = " (toy run: timings meaningless)"


def shape_name(ctx: Context) -> str:
    return "Llama-3-8B-shaped" if ctx.sizes.big_config is LLAMA3_8B else "toy Llama"


def device_memory() -> dict:
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if not stats:
        return {}
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def stage_engine_8b(ctx: Context, budget: Budget, data: dict):
    from pagedjax.models.config import ModelConfig
    from pagedjax.models.llama import kv_pool_bytes_per_block
    from pagedjax.models.loader import LoadedModel

    from pagedjax.bench.throughput_sides import Request, generate_pagedjax

    s = ctx.sizes
    hf_config = big_hf_config(ctx)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    full_layers = s.big_config["num_hidden_layers"]
    data["model"] = (
        f"{shape_name(ctx)} random weights, bfloat16, {config.num_layers} of {full_layers} layers "
        f"(hidden {config.hidden_size}, heads {config.num_heads}/{config.num_kv_heads}, "
        f"vocab {config.vocab_size})"
    )
    say(f"  {data['model']}")
    t = time.perf_counter()
    params = random_params(config, "bfloat16")
    jax.block_until_ready(params)
    data["build_params_s"] = time.perf_counter() - t
    data["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(params))
    loaded = LoadedModel(
        config=config, params=params, source="random-llama-3-8b-shaped", tokenizer_dir=None
    )
    llm = llm_with_weights(
        loaded,
        dtype="bfloat16",
        block_size=16,
        max_model_len=s.max_prompt_len + s.max_output_len,
        max_num_seqs=s.max_num_seqs,
        kv_cache_space_gib=s.kv_cache_space_gib,
        enable_prefix_caching=True,
    )
    try:
        requests = big_workload(ctx, config.vocab_size, seed=0)
        # Warm-up: the same lengths (the same bucketed programs), other tokens (no prefix hits).
        rng = np.random.default_rng(99)
        warm = [
            Request(
                rng.integers(3, config.vocab_size, len(r.prompt_token_ids)).tolist(), r.output_len
            )
            for r in requests
        ]
        data["workload"] = dict(
            num_requests=len(requests),
            mean_prompt_len=float(np.mean([len(r.prompt_token_ids) for r in requests])),
            mean_output_len=float(np.mean([r.output_len for r in requests])),
            max_prompt_len=s.max_prompt_len,
            max_output_len=s.max_output_len,
            max_num_seqs=s.max_num_seqs,
        )
        say(f"  workload: {data['workload']}")
        with compile_events() as cold_events:
            cold = generate_pagedjax(llm, warm)
        data["cold"] = dataclasses.asdict(cold)
        data["cold_compiles"] = summarize_compiles(cold_events)
        say(f"  cold run (compiles included): {cold.elapsed_s:.1f} s, {data['cold_compiles']}")
        budget.check("the timed (warm) run")
        with compile_events() as warm_events:
            timed = generate_pagedjax(llm, requests)
        data["warm"] = dataclasses.asdict(timed)
        data["warm_compiles"] = summarize_compiles(warm_events)
        stats = llm.get_stats()
        data["stats"] = dataclasses.asdict(stats)
        data["kv_pool_bytes"] = stats.num_blocks_total * kv_pool_bytes_per_block(
            config, 16, "bfloat16"
        )
        data["memory"] = device_memory()
        say(
            f"  warm run: {timed.elapsed_s:.1f} s, {timed.output_tokens_per_s:.0f} output tok/s, "
            f"{data['warm_compiles']['count']} programs compiled; KV blocks "
            f"{stats.num_blocks_peak}/{stats.num_blocks_total} peak; memory {data['memory']}"
        )
    finally:
        llm.close()
    peak = data["memory"].get("peak_bytes_in_use")
    summary = (
        f"{shape_name(ctx)} ({config.num_layers}/{full_layers} layers) bf16: "
        f"{timed.output_tokens_per_s:.0f} out tok/s warm; cold {cold.elapsed_s:.0f} s with "
        f"{data['cold_compiles']['count']} compiles ({data['cold_compiles']['total_s']:.0f} s, "
        f"max {data['cold_compiles']['max_s']:.1f}); KV blocks {stats.num_blocks_peak}/"
        f"{stats.num_blocks_total}" + (f"; process peak {peak / 2**30:.1f} GiB" if peak else "")
    )
    return True, summary + TOY_NOTE * ctx.interpret


def summarize_compiles(events: list[tuple[str, float]]) -> dict:
    secs = [d for _, d in events]
    return {
        "count": len(secs),
        "total_s": float(sum(secs)),
        "max_s": float(max(secs, default=0.0)),
        "per_program_s": [(name, round(d, 3)) for name, d in events],
    }


# ---- stage 4: decode-kernel benchmark ---------------------------------------------------------


def stage_decode(ctx: Context, budget: Budget, data: dict):
    if ctx.kernel_backend != "gpu":
        raise StageSkipped("the decode benchmark compares GPU kernels")
    args = decode_bench.parse_args(list(ctx.sizes.bench_argv))
    say(f"  benchmarks/paged_attention_gpu.py {' '.join(ctx.sizes.bench_argv)}")
    say(decode_bench.HEADER)
    rows, nan = decode_bench.run(args)
    info = decode_bench.summary(rows, nan)
    data["rows"] = [dataclasses.asdict(r) for r in rows]
    data["summary"] = info
    ok = info["max_err_ours"] < TOLERANCE["bfloat16"] and info["ours_finite"]
    summary = (
        f"copy {info['copy_gbps']:.0f} GB/s; ours at longest context "
        f"{100 * info['min_fraction_of_copy_at_long_context']:.0f}% of copy; x JAX op min "
        f"{_f(info['min_speedup_vs_jax'])}, geomean {_f(info['geomean_speedup_vs_jax'])}; "
        f"max err {info['max_err_ours']:.1e}; stale NaN: ours finite {info['ours_finite']}, "
        f"JAX finite {info.get('jax_finite', '-')}"
    )
    return ok, summary + TOY_NOTE * ctx.interpret


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


# ---- stage 5: transformers on the same device -------------------------------------------------


def stage_peer(ctx: Context, budget: Budget, data: dict):
    import torch
    import transformers

    from pagedjax.bench.throughput_sides import Request, generate_hf

    device = ctx.torch_device
    if ctx.platform == "tpu":
        raise StageSkipped("no transformers peer on the same device for a TPU")
    if ctx.platform == "gpu" and device != "cuda":
        raise RuntimeError("torch sees no CUDA device: no peer on the same GPU")
    hf_config = big_hf_config(ctx)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(old_dtype)
    model.generation_config.eos_token_id = None
    requests = big_workload(ctx, hf_config.vocab_size, seed=0)
    # Static batches of similar prompt lengths (the peer's best case).
    requests = sorted(requests, key=lambda r: len(r.prompt_token_ids))
    data["model"] = f"transformers LlamaForCausalLM, {hf_config.num_hidden_layers} layers, bf16"
    data["device"] = device
    generate_hf(model, [Request(requests[0].prompt_token_ids[:16], 4)] * 2, 2, device)  # warm-up
    sweep = data.setdefault("sweep", [])
    for bs in ctx.sizes.hf_batch_sizes:
        if budget.left() <= 0:
            data["partial"] = f"batch sizes run: {[r['batch_size'] for r in sweep]}"
            break
        if device == "cuda":
            torch.cuda.synchronize()
        side = generate_hf(model, requests, bs, device)
        sweep.append({"batch_size": bs, **dataclasses.asdict(side)})
        say(
            f"  transformers batch {bs}: {side.elapsed_s:.1f} s, "
            f"{side.output_tokens_per_s:.0f} output tok/s"
        )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if not sweep:
        budget.check("the first batch size")
    best = max(sweep, key=lambda r: r["output_tokens_per_s"])
    data["best"] = best
    ours = ctx.results.get("engine_8b")
    ours_tps = None
    if ours is not None and "warm" in ours.data:
        ours_tps = ours.data["warm"]["output_tokens_per_s"]
        data["pagedjax_over_transformers"] = ours_tps / best["output_tokens_per_s"]
    summary = (
        f"transformers best batch {best['batch_size']}: {best['output_tokens_per_s']:.0f} out "
        f"tok/s"
        + (
            f"; pagedjax / transformers = {ours_tps / best['output_tokens_per_s']:.2f}x"
            if ours_tps
            else "; no pagedjax figure from stage 3 to compare"
        )
    )
    summary += TOY_NOTE * ctx.interpret
    if "partial" in data:
        raise BudgetSpent(summary)
    return True, summary


# ---- stage 6: online serving over HTTP -----------------------------------------------------

WHEELHOUSE = ROOT / "wheelhouse"  # `make wheelhouse`; copied beside the checkout, never committed
SERVE_MODULES = ("fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "httpx2")
PEER_MODULES = {"transformers": ("fastapi", "uvicorn", "pydantic", "openai")}  # its serve command
SERVER_MEM_FRACTION = "0.25"  # a server's JAX share of the GPU; this process holds 0.5


def missing_modules(names) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def install_wheelhouse(data: dict) -> Path | None:
    """pip-install the wheelhouse's wheels (no index, no dependencies) into a temporary directory
    put first on sys.path; that directory, or None when there are no wheels."""
    wheels = sorted(WHEELHOUSE.glob("*.whl"))
    if not wheels:
        return None
    target = Path(tempfile.mkdtemp(prefix="pagedjax-wheels-"))
    atexit.register(shutil.rmtree, target, True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--target", str(target), *map(str, wheels)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install {WHEELHOUSE}:\n{done.stderr[-2000:]}")
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    data["wheelhouse"] = [w.name for w in wheels]
    say(f"  installed {len(wheels)} wheels from {WHEELHOUSE} into {target}")
    return target


@contextlib.contextmanager
def server_environment(ctx: Context, wheels: Path | None):
    """What the started servers need in their environment: this checkout and the wheels on
    PYTHONPATH (PYTHONSAFEPATH: ``python -m pagedjax`` run from the checkout must not import
    its uninstalled pagedjax/ first), and on a GPU a JAX share of its memory that fits beside
    this process's."""
    paths = [str(p) for p in (SOURCE_TREE, wheels) if p is not None]
    env = {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).strip(":")}
    if SOURCE_TREE is not None:
        env["PYTHONSAFEPATH"] = "1"
    if ctx.platform == "gpu":
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = SERVER_MEM_FRACTION
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def serve_peers(ctx: Context, data: dict) -> list[str]:
    """The peers that can start here (a NAME=COMMAND entry is a --peer command); the others
    are recorded under ``peers_skipped`` with the reason."""
    from pagedjax.bench.serve_peers import _find_exe

    ready, skipped = [], {}
    for peer in ctx.sizes.serve.peers:
        if "=" in peer:
            ready.append(peer)
            continue
        lacking = missing_modules(PEER_MODULES.get(peer, ()))
        if _find_exe(peer) is None:
            skipped[peer] = f"no {peer!r} executable beside {sys.executable} or on PATH"
        elif lacking:
            needs = ", ".join(lacking)
            skipped[peer] = f"{peer} serve needs {needs} (make wheelhouse, then copy it here)"
        else:
            ready.append(peer)
    if skipped:
        data["peers_skipped"] = skipped
        for peer, why in skipped.items():
            say(f"  peer {peer} skipped: {why}")
    return ready


def serve_common_argv(ctx: Context, model_dir: Path, scratch: Path) -> list[str]:
    sv = ctx.sizes.serve
    pagedjax_flags = ["--max-num-seqs", str(sv.max_num_seqs), "--num-blocks", str(sv.num_blocks)]
    return [
        *("--model", str(model_dir), "--dtype", sv.dtype, "--max-model-len", str(sv.max_model_len)),
        # Already without EOS; the copy (hard links) tells bench serve so, as the CPU command does.
        *("--disable-eos-copy", str(scratch / "model-no-eos")),
        *("--server-args", "pagedjax=" + " ".join([*pagedjax_flags, *sv.pagedjax_args])),
        *("--dataset-name", "random", "--random-input-len", str(sv.input_len)),
        *("--random-output-len", str(sv.output_len), "--num-prompts", str(max(sv.num_prompts))),
        *("--sweep-concurrency", ",".join(map(str, sv.concurrency))),
        *("--sweep-num-prompts", ",".join(map(str, sv.num_prompts))),
        *("--num-warmups", "2", "--seed", "0", "--request-timeout", f"{sv.request_timeout_s:g}"),
        *("--disable-tqdm", "--log-dir", str(ctx.out / "serve_logs")),
        *("--plot", str(scratch / "sweep.png")),  # one server's; the stage draws both together
    ]


def run_bench_serve(argv: list[str]) -> dict:
    from pagedjax.bench import serve

    say(f"  $ pagedjax bench serve {shlex.join(argv)}")
    return serve.execute(serve.build_parser().parse_args(argv))


def serve_row_line(row: dict) -> str:
    return (
        f"  {row['server']:<14}{row['max_concurrency']:>6}{row['completed']:>6}{row['failed']:>6}"
        f"{row['exact_lengths']:>7}{row['output_throughput']:>11.1f}"
        f"{_f(row['ttft']['median']):>11}{_f(row['tpot']['median']):>11}"
        f"{_f(row['e2el']['median']):>11}"
    )


def stage_serve(ctx: Context, budget: Budget, data: dict):
    from pagedjax.bench import serve_metrics
    from pagedjax.bench.serve_model import save_random_llama

    sv = ctx.sizes.serve
    if ctx.platform == "tpu":
        raise StageSkipped("the serving comparison runs its peers on a GPU (torch), not a TPU")
    wheels = None
    if missing_modules(SERVE_MODULES):
        wheels = install_wheelhouse(data)
    lacking = missing_modules(SERVE_MODULES)
    if lacking:
        raise StageSkipped(
            f"pagedjax serve / bench serve need {', '.join(lacking)}, absent here and not in "
            f"{WHEELHOUSE}: run `make wheelhouse` on a machine with an index and copy "
            "wheelhouse/ beside this checkout"
        )
    peers = serve_peers(ctx, data)
    scratch = Path(tempfile.mkdtemp(prefix="pagedjax-serve-"))
    try:
        t = time.perf_counter()
        model_dir = save_random_llama(
            scratch / "model", sv.model, dtype=sv.dtype, device=ctx.torch_device
        )
        if ctx.torch_device == "cuda":
            import torch

            torch.cuda.empty_cache()
        data["model"] = f"random Llama {sv.model['hidden_size']}x{sv.model['num_hidden_layers']}"
        data["model"] += f" (vocab {sv.model['vocab_size']}), {sv.dtype}, no EOS"
        data["build_model_s"] = time.perf_counter() - t
        common = serve_common_argv(ctx, model_dir, scratch)
        known = ",".join(p for p in peers if "=" not in p)
        compare = (["--compare", known] if known else []) + [
            a for p in peers if "=" in p for a in ("--peer", p)
        ]
        data["command"] = "pagedjax bench serve " + shlex.join(
            [*compare, *common, "--server-timeout", f"{sv.server_timeout_s:g}"]
        )
        results = []
        with server_environment(ctx, wheels):
            budget.check("pagedjax serve")
            timeout = min(sv.server_timeout_s, max(budget.left() - 10, 10))
            argv = [*common, "--start-pagedjax", "--server-timeout", f"{timeout:g}"]
            results.append(run_bench_serve(argv))
            for peer in peers:
                if budget.left() < 30:
                    data["partial"] = f"peer {peer} not run: the budget was spent on the others"
                    break
                flag = ["--peer", peer] if "=" in peer else ["--compare", peer]
                timeout = min(sv.server_timeout_s, budget.left())
                argv = [*common, "--no-pagedjax", *flag, "--server-timeout", f"{timeout:g}"]
                results.append(run_bench_serve(argv))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    servers = [srv for res in results for srv in res["servers"]]
    rows = [row for srv in servers for row in srv["rows"]]
    data["servers"] = [
        serve_metrics._jsonable({k: v for k, v in srv.items() if k != "rows"}) for srv in servers
    ]
    data["rows"] = serve_metrics._jsonable(rows)
    say(
        f"  {'server':<14}{'conc':>6}{'ok':>6}{'fail':>6}{'exact':>7}{'out tok/s':>11}"
        f"{'TTFT p50':>11}{'TPOT p50':>11}{'E2E p50':>11}   (ms)"
    )
    for row in rows:
        say(serve_row_line(row))
    if rows:
        data["plot"] = serve_metrics.plot_sweep(
            rows, "max_concurrency", str(ctx.out / "bench_serve.png")
        )
    ours = {r["max_concurrency"]: r for r in rows if r["server"] == "pagedjax"}
    data["ratios"] = [
        {
            "peer": r["server"],
            "max_concurrency": c,
            "output_throughput": ours[c]["output_throughput"] / r["output_throughput"],
            "ttft_median": _ratio(ours[c]["ttft"]["median"], r["ttft"]["median"]),
        }
        for r in rows
        if r["server"] != "pagedjax"
        and (c := r["max_concurrency"]) in ours
        and r["output_throughput"] > 0
    ]
    for q in data["ratios"]:
        say(
            f"  pagedjax / {q['peer']} at concurrency {q['max_concurrency']}: output tok/s "
            f"{q['output_throughput']:.2f}x, TTFT p50 {_f(q['ttft_median'])}x"
        )
    started = [srv for srv in servers if "start_error" not in srv]
    failed = [srv["server"] for srv in servers if "start_error" in srv]
    ok = bool(rows) and not failed and all(r["failed"] == 0 for r in rows)
    parts = [
        f"{srv['server']} " + "/".join(f"{r['output_throughput']:.0f}" for r in srv["rows"])
        for srv in started
    ]
    summary = (
        f"out tok/s at concurrency {'/'.join(map(str, sv.concurrency))}: {'; '.join(parts)}"
        + "".join(
            f"; x {q['peer']} at {q['max_concurrency']}: {q['output_throughput']:.2f}"
            for q in data["ratios"]
        )
        + f"; exact lengths {sum(r['exact_lengths'] for r in rows)}/"
        f"{sum(r['completed'] for r in rows)}"
        + (f"; did not start: {', '.join(failed)}" if failed else "")
        + (f"; skipped: {', '.join(data['peers_skipped'])}" if "peers_skipped" in data else "")
    )
    summary += TOY_NOTE * ctx.interpret
    if "partial" in data:
        raise BudgetSpent(summary)
    return ok, summary


def _ratio(a, b):
    return None if a is None or not b else a / b


# ---- main -------------------------------------------------------------------------------------

STAGES = {  # key -> (number, title, function)
    "env": ("1", "environment", stage_env),
    "kernels": ("2", "kernel correctness vs float32 reference", stage_kernels),
    "engine_tiny": (
        "3a",
        "engine: tiny Llama vs transformers, preemption, prefix caching",
        stage_engine_tiny,
    ),
    "engine_8b": ("3b", "engine: Llama-3-8B-shaped bfloat16 throughput", stage_engine_8b),
    "decode": ("4", "decode-kernel benchmark", stage_decode),
    "peer": ("5", "transformers on the same device", stage_peer),
    "serve": ("6", "online serving: pagedjax serve vs transformers serve", stage_serve),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("device_check_out"), help="JSON + log here")
    p.add_argument("--toy", action="store_true", help="toy sizes, Pallas kernels interpreted (CPU)")
    p.add_argument(
        "--stages", default="1,2,3,4,5,6", help="comma-separated stage numbers or names to run"
    )
    p.add_argument("--big-layers", type=int, help="layers of the 8B-shaped model (of 32)")
    p.add_argument("--num-requests", type=int, help="requests in the stage-3b/5 workload")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage budget")
    args = p.parse_args(argv)
    wanted = {s.strip() for s in args.stages.split(",") if s.strip()}
    picks = {w: [k for k, (n, _, _) in STAGES.items() if w in (k, n, n[0])] for w in wanted}
    unknown = sorted(w for w, keys in picks.items() if not keys)
    if unknown:
        p.error(f"unknown stages {unknown}; choose numbers 1-6 (3a, 3b) or names {list(STAGES)}")
    args.stage_keys = [k for k in STAGES if any(k in keys for keys in picks.values())]
    return args


class Tee:
    """Write to the console and the log file, flushing both."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # encoding, fileno, ...: the console's
        return getattr(self.streams[0], name)


def summary_table(ctx: Context) -> str:
    lines = ["| # | stage | status | s | result |", "|---|---|---|---|---|"]
    for key, r in ctx.results.items():
        n = STAGES[key][0]
        text = r.summary.replace("|", "/").replace("\n", " ")
        lines.append(f"| {n} | {key} | {r.status} | {r.seconds:.0f} | {text} |")
    return "\n".join(lines)


def main(argv=None) -> Context:
    args = parse_args(argv)
    sizes = TOY if args.toy else DEVICE
    if args.big_layers:
        sizes = dataclasses.replace(sizes, big_layers=args.big_layers)
    if args.num_requests:
        sizes = dataclasses.replace(sizes, num_requests=args.num_requests)
    sizes = dataclasses.replace(
        sizes, budgets={k: v * args.budget_scale for k, v in sizes.budgets.items()}
    )
    backend = jax.default_backend()
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(["python3 benchmarks/device_check.py", *argv])
    ctx = Context(sizes, backend, interpret=args.toy, out=args.out, command=command)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.out.resolve().is_relative_to(ROOT):  # results inside the checkout stay out of git
        (args.out / ".gitignore").write_text("*\n")
    with (
        open(args.out / "device_check.log", "w") as log,
        contextlib.redirect_stdout(Tee(sys.stdout, log)),
        contextlib.redirect_stderr(Tee(sys.stderr, log)),
    ):
        start = time.perf_counter()
        say(f"pagedjax device check: {ctx.command}  ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})")
        if backend not in ("gpu", "tpu") and not args.toy:
            say(f"no GPU or TPU here (JAX backend {backend!r}): use --toy for a CPU smoke run")
            raise SystemExit(2)
        for key in args.stage_keys:
            _, title, fn = STAGES[key]
            run_stage(ctx, key, title, fn, sizes.budgets[key])
        say(f"\n== summary ({time.perf_counter() - start:.0f} s; JSON and log in {args.out}) ==")
        say(summary_table(ctx))
    return ctx


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(r.status in ("PASS", "SKIP") for r in result.results.values()) else 1)
