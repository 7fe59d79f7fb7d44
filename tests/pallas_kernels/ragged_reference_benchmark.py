"""CPU timing of the ragged reference against the layout it replaced (padded per sequence).

    .venv/bin/python tests/pallas_kernels/ragged_reference_benchmark.py [--repeats N] [--small]

Both jit-compiled, warmed up, then timed side by side in one run (min and median of the repeats);
the outputs are compared too. Shapes are SmolLM2-135M's attention (9 heads, 3 KV heads, head_dim
64, float32, 16-token blocks), one layer, with the engine's buckets: token count and sequence
slots to powers of two, the longest query to a power of four from 16, block tables to a power of
two of at least 256 tokens. Cases: (a) 63 decodes over ~300-token contexts and one 128-token
prompt, (b) four 128-token prompts, (c) 64 decodes. Check the machine's load first.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import ragged_case, rel_err  # noqa: E402
from pagedjax.pallas_kernels import (  # noqa: E402
    paged_attention_reference,
    ragged_paged_attention_reference,
)
from pagedjax.pallas_kernels.reference import gather_context  # noqa: E402

SHAPE = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=jnp.float32)


def padded_reference(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale, max_query_len
):
    """The previous reference: every sequence padded to max_query_len rows, each attending its
    whole gathered context (decode-only calls took the decode reference, as now)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    max_q = max_query_len
    if max_q == 1:
        starts = jnp.clip(query_start_loc[:-1], 0, num_tokens - 1)
        out = paged_attention_reference(
            q[starts], k_pages, v_pages, block_tables, context_lens, scale=scale
        )
        has_q = query_start_loc[1:] > query_start_loc[:-1]
        out = jnp.where(has_q[:, None, None], out, 0)
        return jnp.zeros_like(q).at[jnp.where(has_q, starts, num_tokens)].set(out, mode="drop")
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    j = jnp.arange(max_q)
    rows = query_start_loc[:-1, None] + j[None, :]
    q_pad = q[jnp.clip(rows, 0, num_tokens - 1)]
    q_pad = q_pad.reshape(num_seqs, max_q, num_kv_heads, group, head_dim).astype(jnp.float32)
    k = gather_context(k_pages, block_tables).astype(jnp.float32)
    v = gather_context(v_pages, block_tables).astype(jnp.float32)
    t = jnp.arange(k.shape[2])
    kv_valid = t[None, :] < context_lens[:, None]
    q_pos = (context_lens - q_lens)[:, None] + j[None, :]
    mask = kv_valid[:, None, :] & (t[None, None, :] <= q_pos[:, :, None])
    v = jnp.where(mask.any(axis=1)[:, None, :, None], v, 0)
    s = jnp.einsum("sqkgd,sktd->skgqt", q_pad, k) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("skgqt,sktd->sqkgd", p / jnp.where(denom == 0, 1, denom), v)
    out = out.reshape(num_seqs, max_q, num_heads, head_dim)
    n = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, n, side="right") - 1, 0, num_seqs - 1)
    jj = n - query_start_loc[seq]
    in_range = (n < query_start_loc[-1]) & (jj < max_q)
    packed = out[seq, jnp.clip(jj, 0, max_q - 1)]
    return jnp.where(in_range[:, None, None], packed, 0).astype(q.dtype)


def next_pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def query_bucket(n: int) -> int:
    b = 16
    while b < n:
        b *= 4
    return b


def engine_step(rng, seqs):
    """A step as the engine pads it: seqs are (context_len, query_len), decodes first."""
    bs = SHAPE["block_size"]
    num_tokens = sum(n for _, n in seqs)
    max_q = max(n for _, n in seqs)
    slots = next_pow2(len(seqs), 8)
    decode = max_q == 1
    padded_tokens = slots if decode else next_pow2(num_tokens, 32)
    padded = list(seqs) + [(0, 0)] * (slots - len(seqs))
    case = ragged_case(rng, padded, pad_rows=padded_tokens - num_tokens, **SHAPE)
    q = jnp.where(jnp.isnan(case.q), 0, case.q)  # the engine's padding rows are finite
    max_blocks = max(-(-c // bs) for c, _ in seqs)
    cols = max(next_pow2(max_blocks), 256 // bs, case.block_tables.shape[1])
    table = jnp.pad(case.block_tables, ((0, 0), (0, cols - case.block_tables.shape[1])))
    qsl = np.asarray(case.query_start_loc)
    if decode:  # decode layout: row i is sequence i (padding sequences own padding rows)
        qsl = np.arange(slots + 1, dtype=np.int32)
    max_query_len = 1 if decode else min(query_bucket(max_q), padded_tokens)
    args = (q, case.k_pages, case.v_pages, table, case.context_lens, jnp.asarray(qsl))
    return args, case.scale, max_query_len


def cases(rng, small: bool):
    if small:
        return {
            "(a) mixed": [(int(rng.integers(20, 40)), 1) for _ in range(7)] + [(24, 24)],
            "(b) prefill": [(24, 24)] * 2,
            "(c) decode": [(int(rng.integers(20, 40)), 1) for _ in range(8)],
        }
    return {
        "(a) 63 decodes ~300 + 128-token prompt": [
            (int(rng.integers(280, 321)), 1) for _ in range(63)
        ]
        + [(128, 128)],
        "(b) 4 x 128-token prompts": [(128, 128)] * 4,
        "(c) 64 decodes ~300": [(int(rng.integers(280, 321)), 1) for _ in range(64)],
    }


def timed(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    opts = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"load average: {os.getloadavg()}  cpus: {os.cpu_count()}  jax {jax.__version__}")
    print("| case | old min / median ms | new min / median ms | old / new (min) | new vs old |")
    print("|---|---|---|---|---|")
    rows = []
    for name, seqs in cases(rng, opts.small).items():
        args, scale, max_q = engine_step(rng, seqs)
        old = jax.jit(functools.partial(padded_reference, scale=scale, max_query_len=max_q))
        new = jax.jit(
            functools.partial(ragged_paged_attention_reference, scale=scale, max_query_len=max_q)
        )
        err = rel_err(new(*args), old(*args))
        (old_min, old_med), (new_min, new_med) = (timed(f, args, opts.repeats) for f in (old, new))
        rows.append(dict(case=name, old=old_min, new=new_min, err=err))
        print(
            f"| {name} | {1e3 * old_min:.2f} / {1e3 * old_med:.2f} | {1e3 * new_min:.2f} / "
            f"{1e3 * new_med:.2f} | {old_min / new_min:.2f}x | rel err {err:.1e} |"
        )
    return rows


if __name__ == "__main__":
    main()
