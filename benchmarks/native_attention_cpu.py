"""CPU paged attention per layer: the native FFI kernel vs XLA's path (as dispatched without it).

At SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16, a
pool of ~3000 blocks) and 64 sequences, on the same arrays in one run:
  * decode, contexts 100-200 in 16-block tables (XLA: ``paged_attention_reference``) and
    256-512 in 32-block tables (XLA: ``paged_attention_chunked``);
  * 64 decodes of 160 keys that share 10 blocks, whose pages stay in cache (the decode's
    arithmetic alone);
  * one ragged step: a 128-token prefill plus 63 decodes (XLA:
    ``ragged_paged_attention_reference``);
  * a prefill step of 16 prompts of 128 tokens, whose pages are in cache (the arithmetic
    bounds it, not memory).
The native kernel runs on one thread and on all of XLA's intra-op threads. Reported: min and
median of ``--repeats`` timed calls, the live K/V bytes read / time (GB/s), and as the machine's
limit the read bandwidth of a large array's sum measured in the same run.

    python benchmarks/native_attention_cpu.py                 # ~1 min on 2 cores
    python benchmarks/native_attention_cpu.py --dtype bfloat16 --repeats 50

``--layouts`` times instead a whole decode step's attention as the engine runs it: 30 layers in
one program over a pool of the engine's size for the throughput benchmark (3 x 30 x 1456 blocks),
64 sequences of 20-191 tokens, caches flushed between calls (a 256 MiB read), for three ways
a block allocator can lay out the same tables: scattered blocks (a FIFO free list after long
use), each prompt's blocks adjacent but descending (a FIFO list after one run: sequences free
their tail first), and lowest first (block_pool.LowestFirst: a prompt's blocks ascending, the two
blocks decoding appended interleaved across the sequences).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from pagedjax.pallas_kernels import (  # noqa: E402
    NativeBackend,
    paged_attention_reference,
    quantize_kv,
    ragged_paged_attention_reference,
)
from pagedjax.pallas_kernels.attention import flat_entry  # noqa: E402
from pagedjax.pallas_kernels.cpu import chunked_decode  # noqa: E402
from pagedjax.pallas_kernels.cpu import native as na  # noqa: E402

# The backends' kernels over the flat arguments, as the references take them.
paged_attention_chunked = flat_entry(
    chunked_decode, name="paged_attention_chunked", ragged=False, doc="XLA's chunked decode"
)
paged_attention_native = flat_entry(
    lambda q, kv, md, opts, **knobs: NativeBackend(**knobs).decode(q, kv, md, opts),
    name="paged_attention_native",
    ragged=False,
    doc="the native decode kernel",
)
ragged_paged_attention_native = flat_entry(
    lambda q, kv, md, opts, **knobs: NativeBackend(**knobs).ragged(q, kv, md, opts),
    name="ragged_paged_attention_native",
    ragged=True,
    doc="the native ragged kernel",
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M
NUM_BLOCKS = 3000


@dataclasses.dataclass
class Case:
    name: str
    args: tuple  # the attention's positional arrays
    kwargs: dict  # its keyword arrays / statics
    xla: object  # the XLA path's function
    native: object
    kv_bytes: int  # live K/V bytes one call reads


def pool(rng, dtype):
    shape = (NUM_KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape, np.float32))
    v = jnp.asarray(rng.standard_normal(shape, np.float32))
    if dtype in ("int8", "float8_e4m3fn"):
        k, ks = quantize_kv(k, jnp.dtype(dtype))
        v, vs = quantize_kv(v, jnp.dtype(dtype))
        return k, v, {"k_scales": ks, "v_scales": vs}
    return k.astype(dtype), v.astype(dtype), {}


def tables(rng, lens, width):
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))[: len(lens) * width]
    return jnp.asarray(ids.reshape(len(lens), width).astype(np.int32))


def live_bytes(lens, k_pages, quantized: bool) -> int:
    scales = 4 * NUM_KV_HEADS if quantized else 0  # an f32 scale per slot and KV head
    per_token = NUM_KV_HEADS * HEAD_DIM * k_pages.dtype.itemsize + scales
    return 2 * int(np.sum(lens)) * per_token  # K and V


def decode_case(rng, dtype, lo, hi, width, xla_fn) -> Case:
    k, v, scales = pool(rng, dtype)
    lens = rng.integers(lo, hi + 1, 64).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((64, NUM_HEADS, HEAD_DIM), np.float32))
    args = (q, k, v, tables(rng, lens, width), jnp.asarray(lens))
    kw = {"scale": HEAD_DIM**-0.5, **scales}
    name = f"decode ctx {lo}-{hi}, {width}-block tables"
    read = live_bytes(lens, k, bool(scales))
    return Case(name, args, kw, xla_fn, paged_attention_native, read)


def cached_decode_case(rng, dtype) -> Case:
    """64 decodes of 160 keys that all read the same 10 blocks (240 KB of float32 pages, in L2):
    the decode's arithmetic alone, to set against the cases whose pages come from memory."""
    k, v, scales = pool(rng, dtype)
    lens = np.full(64, 160, np.int32)
    shared = jnp.asarray(np.tile(np.arange(1, 11, dtype=np.int32), (64, 1)))
    q = jnp.asarray(rng.standard_normal((64, NUM_HEADS, HEAD_DIM), np.float32))
    args = (q, k, v, shared, jnp.asarray(lens))
    kw = {"scale": HEAD_DIM**-0.5, **scales}
    read = live_bytes(lens, k, bool(scales))  # as if each sequence's pages were its own
    return Case(
        "decode ctx 160, 10 shared blocks (cache)",
        args,
        kw,
        paged_attention_reference,
        paged_attention_native,
        read,
    )


def ragged_case(rng, dtype) -> Case:
    k, v, scales = pool(rng, dtype)
    lens = np.concatenate([[128], rng.integers(100, 201, 63)]).astype(np.int32)
    q_lens = np.array([128] + [1] * 63)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(qsl[-1]), NUM_HEADS, HEAD_DIM), np.float32))
    args = (q, k, v, tables(rng, lens, 16), jnp.asarray(lens), jnp.asarray(qsl))
    kw = {"scale": HEAD_DIM**-0.5, "max_query_len": 128, **scales}
    # The prefill's tiles each read the prefill's pages once.
    tiles = -(-128 // na.TILE_ROWS)
    read = live_bytes(lens[1:], k, bool(scales)) + tiles * live_bytes(lens[:1], k, bool(scales))
    return Case(
        "ragged 128-token prefill + 63 decodes",
        args,
        kw,
        ragged_paged_attention_reference,
        ragged_paged_attention_native,
        read,
    )


def prefill_case(rng, dtype) -> Case:
    """16 prompts of 128 tokens (the throughput benchmark's first step): the pages were just
    written, so they are in cache and the kernel's arithmetic bounds it."""
    k, v, scales = pool(rng, dtype)
    lens = np.full(16, 128, np.int32)
    qsl = (np.arange(17) * 128).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((2048, NUM_HEADS, HEAD_DIM), np.float32))
    args = (q, k, v, tables(rng, lens, 8), jnp.asarray(lens), jnp.asarray(qsl))
    kw = {"scale": HEAD_DIM**-0.5, "max_query_len": 128, **scales}
    tiles = -(-128 // na.TILE_ROWS)  # each tile reads its sequence's pages once
    return Case(
        "prefill 16 x 128 tokens",
        args,
        kw,
        ragged_paged_attention_reference,
        ragged_paged_attention_native,
        tiles * live_bytes(lens, k, bool(scales)),
    )


def time_calls(fns: list, args, repeats: int) -> list[tuple[float, float]]:
    """(min, median) seconds per jitted fn over ``repeats`` rounds, after two warm-up calls each.
    Each round calls every fn once, so a change in the machine's load hits them alike."""
    for fn in fns:
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
    return [(min(ts), statistics.median(ts)) for ts in times]


def read_gbps(repeats: int) -> float:
    """Reading a 256 MiB f32 array (XLA's sum, on every core): the machine's limit here. (XLA's
    elementwise copy is slower on this CPU; numpy's one-thread copy about the same.)"""
    x = jnp.ones((64 << 20,), jnp.float32)
    ((best, _),) = time_calls([jax.jit(jnp.sum)], (x,), repeats)
    return x.nbytes / best / 1e9


def max_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


LAYERS, LAYER_BLOCKS = 30, 1456  # the throughput benchmark's pool: 1456 blocks per layer


def layout_tables(rng, blocks: np.ndarray, layout: str) -> np.ndarray:
    """i32[num_seqs, width] tables of ``blocks[i]`` blocks each, within one layer's blocks."""
    width = int(blocks.max())
    tables = np.zeros((len(blocks), width), np.int32)
    if layout == "scattered":
        ids, start = rng.permutation(np.arange(1, LAYER_BLOCKS)), 0
        for i, n in enumerate(blocks):
            tables[i, :n] = ids[start : start + n]
            start += n
        return tables
    prompt = np.maximum(blocks - 2, 1)  # the last two blocks were appended while decoding
    nxt = 1
    for i, n in enumerate(prompt):
        run = np.arange(nxt, nxt + n)
        tables[i, :n] = run if layout == "lowest first" else run[::-1]
        nxt += n
    for j in range(2):
        for i in range(len(blocks)):
            if prompt[i] + j < blocks[i]:
                tables[i, prompt[i] + j] = nxt
                nxt += 1
    return tables


def layouts(repeats: int) -> None:
    rng = np.random.default_rng(0)
    shape = (NUM_KV_HEADS, LAYERS * LAYER_BLOCKS, BLOCK, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape, np.float32))
    v = jnp.asarray(rng.standard_normal(shape, np.float32))
    lens = rng.integers(20, 192, 64).astype(np.int32)
    blocks = -(-lens // BLOCK)
    q = jnp.asarray(rng.standard_normal((64, NUM_HEADS, HEAD_DIM), np.float32))

    @jax.jit
    def step(q, k, v, tables, lens):  # each layer reads its own blocks, as the engine's scan
        outs = [
            paged_attention_native(q + i, k, v, tables + i * LAYER_BLOCKS, lens, scale=0.125)
            for i in range(LAYERS)
        ]
        return sum(o[:, 0, 0] for o in outs)

    flush, total = jnp.ones((64 << 20,), jnp.float32), jax.jit(jnp.sum)
    names = ("scattered", "descending runs", "lowest first")
    tables = {n: jnp.asarray(layout_tables(rng, blocks, n)) for n in names}
    times = {n: [] for n in names}
    args = lambda n: (q, k, v, tables[n], jnp.asarray(lens))  # noqa: E731
    for n in names:
        jax.block_until_ready(step(*args(n)))
    for _ in range(repeats):
        for n in names:
            total(flush).block_until_ready()
            t0 = time.perf_counter()
            jax.block_until_ready(step(*args(n)))
            times[n].append(time.perf_counter() - t0)
    kv = live_bytes(lens, k, False) * LAYERS
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"decode attention, {LAYERS} layers, 64 sequences of 20-191 tokens: {kv / 1e6:.0f} MB")
    print(f"{'block tables':<18} {'min ms':>8} {'med ms':>8} {'GB/s':>7}")
    for n in names:
        best = min(times[n])
        print(f"{n:<18} {best * 1e3:8.2f} {statistics.median(times[n]) * 1e3:8.2f} ", end="")
        print(f"{kv / best / 1e9:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "int8", "float8_e4m3fn")
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", action="store_true", help="a decode step over 3 layouts")
    opts = parser.parse_args()
    if not na.available():
        sys.exit("the native kernel is unavailable (PAGEDJAX_NATIVE=0, or its build failed)")
    if opts.layouts:
        return layouts(opts.repeats)
    rng = np.random.default_rng(opts.seed)
    cases = [
        decode_case(rng, opts.dtype, 100, 200, 16, paged_attention_reference),
        decode_case(rng, opts.dtype, 256, 512, 32, paged_attention_chunked),
        cached_decode_case(rng, opts.dtype),
        ragged_case(rng, opts.dtype),
        prefill_case(rng, opts.dtype),
    ]
    print(f"uptime: {os.popen('uptime').read().strip()}")
    limit = read_gbps(opts.repeats)
    print(f"jax {jax.__version__}, {os.cpu_count()} cpus, pool {opts.dtype}, ", end="")
    print(f"read bandwidth {limit:.1f} GB/s (jnp.sum of 256 MiB f32)")
    head = (
        f"{'case':<40} {'path':<12} {'min ms':>8} {'med ms':>8} {'GB/s':>7} {'of read':>7} "
        f"{'x XLA':>6}"
    )
    print(head)
    print("-" * len(head))
    for case in cases:
        paths = {
            "xla": functools.partial(case.xla, **case.kwargs),
            "native 1 thr": functools.partial(case.native, **case.kwargs, num_threads=1),
            "native all": functools.partial(case.native, **case.kwargs),
        }
        fns = {label: jax.jit(fn) for label, fn in paths.items()}
        ref = fns["xla"](*case.args)
        for label, fn in fns.items():
            err = max_err(fn(*case.args), ref)
            if err > 1e-2:
                sys.exit(f"{case.name} {label}: relative error {err:.2e} against XLA's")
        timed = time_calls(list(fns.values()), case.args, opts.repeats)
        xla_min = timed[0][0]
        for label, (best, med) in zip(fns, timed, strict=True):
            gbps = case.kv_bytes / best / 1e9
            print(
                f"{case.name:<40} {label:<12} {best * 1e3:8.3f} {med * 1e3:8.3f} "
                f"{gbps:7.2f} {gbps / limit:7.1%} {xla_min / best:6.2f}"
            )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
