"""The layer scan's matmuls on a CPU: the native kernel reading ``w[layer]`` in place against
XLA's dot of the scanned slice (which XLA copies out of the stack first), side by side.

For each row count M, a ``lax.scan`` over 30 layers multiplies an [M, 576] input by each layer's
[576, 1536] kernel (SmolLM2's up projection, 106 MB of float32 weights), once through
``layer_matmul`` (native) and once through ``layer_matmul_reference`` (XLA), the two timed
alternately; then the tied LM head, ``x @ table.T`` with SmolLM2's [49152, 576] table, through
``matmul_transposed`` (the row-major table) and through ``packed_matmul_transposed`` (the table
packed by ``pack_table``, as the runner holds it on a CPU), each against XLA's dot. Min of
``--repeats``; check the load first (``uptime``), the script prints it.

    python benchmarks/layer_matmul_cpu.py [--rows 1 8 64 256 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import time


def _min_time(fns: dict, args: tuple, repeats: int) -> dict[str, float]:
    import jax

    for f in fns.values():
        jax.block_until_ready(f(*args))
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():  # alternate, so that load drifts hit both alike
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from pagedjax.pallas_kernels import native
    from pagedjax.pallas_kernels.layer_matmul import (
        SYMBOLS,
        layer_matmul,
        layer_matmul_reference,
        matmul_transposed,
        matmul_transposed_reference,
        pack_table,
        packed_matmul_transposed,
    )

    if native.load("matmul_cpu", SYMBOLS) is None:
        raise SystemExit("the native matmul kernel is not available here (see the warning)")
    print(f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    rng = np.random.default_rng(0)
    L, K, N = args.layers, 576, 1536
    w = jnp.asarray(0.02 * rng.standard_normal((L, K, N), np.float32))
    table = jnp.asarray(0.02 * rng.standard_normal((49152, K), np.float32))

    def scanned(fn):
        def run(x, w):
            body = lambda acc, layer: (acc + fn(x, w, layer).sum(), None)  # noqa: E731
            return jax.lax.scan(body, 0.0, jnp.arange(L, dtype=jnp.int32))[0]

        return jax.jit(run)

    layer_fns = {"native": scanned(layer_matmul), "xla": scanned(layer_matmul_reference)}
    head_fns = {"native": jax.jit(matmul_transposed), "xla": jax.jit(matmul_transposed_reference)}
    tables = (table, jax.jit(pack_table)(table))  # row-major, packed
    packed_fns = {
        "native": jax.jit(lambda x, t: packed_matmul_transposed(x, t[1])),
        "xla": jax.jit(lambda x, t: matmul_transposed_reference(x, t[0])),
    }
    print(f"{'rows':>5} {'op':<24} {'native ms':>10} {'xla ms':>8} {'xla/native':>10} GFLOP/s")
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, K), np.float32))
        for name, fns, operand, flop in (
            (f"{L} layers 576x1536", layer_fns, w, 2 * m * K * N * L),
            ("tied head 49152x576", head_fns, table, 2 * m * K * table.shape[0]),
            ("tied head, packed", packed_fns, tables, 2 * m * K * table.shape[0]),
        ):
            t = _min_time(fns, (x, operand), args.repeats)
            rates = " / ".join(f"{flop / t[k] / 1e9:.0f}" for k in ("native", "xla"))
            print(
                f"{m:>5} {name:<24} {t['native'] * 1e3:>10.2f} {t['xla'] * 1e3:>8.2f} "
                f"{t['xla'] / t['native']:>10.2f} {rates}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
