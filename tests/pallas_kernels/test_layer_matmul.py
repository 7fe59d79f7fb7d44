"""``layer_matmul``: x @ w[layer] read in place from a stacked kernel (native on CPU), against a
float64 oracle; its fallbacks; and the model step reading its kernels in place."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pagedjax.pallas_kernels import (
    layer_matmul,
    layer_matmul_reference,
    matmul_transposed,
    matmul_transposed_reference,
    native,
    pack_stacked,
    pack_table,
    packed_layer_matmul,
    packed_matmul_transposed,
    packed_take,
    unpack_stacked,
    unpack_table,
)
from pagedjax.pallas_kernels.layer_matmul import (
    SYMBOLS,
    TRANSPOSED_NATIVE_MAX_ROWS,
    CpuLinearMethods,
    InPlaceLinear,
    NativeTable,
    PackedLinear,
    PackedTable,
    native_supported,
    packed_layer_matmul_reference,
)

NATIVE = native.load("matmul_cpu", SYMBOLS) is not None


def oracle(x, w, layer):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)[layer]


def _arrays(m, k, n, layers, x_dtype, w_dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    w = jnp.asarray(rng.standard_normal((layers, k, n)) / np.sqrt(k), w_dtype)
    return x, w


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler: XLA's path serves")
def test_every_native_source_builds_where_a_compiler_is():
    """With a compiler (this machine's and CI's g++), both kernels build and load: a source that
    no longer compiles fails here, not as a silent fallback (or skipped kernel tests)."""
    from pagedjax.pallas_kernels.cpu import native as native_attention

    assert NATIVE
    assert native_attention.available()


# Rows: each register-block size and the remainders; columns: whole tiles of each width, tiles
# narrower at the edge and fewer than 16 columns; SmolLM2's shapes.
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 576, 1536), (2, 64, 200), (3, 37, 129), (5, 64, 48), (8, 576, 192), (9, 33, 16),
     (17, 40, 7), (64, 96, 1000), (0, 8, 16)],
)  # fmt: skip
def test_f32_against_float64(m, k, n):
    x, w = _arrays(m, k, n, 3, jnp.float32, jnp.float32)
    for layer in (0, 2):
        got = jax.jit(layer_matmul)(x, w, jnp.int32(layer))
        assert got.shape == (m, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), oracle(x, w, layer), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_operands(x_dtype, w_dtype):
    x, w = _arrays(6, 80, 144, 2, x_dtype, w_dtype, seed=1)
    got = jax.jit(layer_matmul)(x, w, jnp.int32(1))
    assert got.dtype == x_dtype
    want = oracle(x, w, 1)  # of the rounded operands: only the output's rounding differs
    tol = 1e-5 if x_dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    ref = jax.jit(layer_matmul_reference)(x, w, jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64),
                               rtol=tol, atol=tol)  # fmt: skip


def test_under_a_scan_each_layer_reads_its_own_kernel():
    x, w = _arrays(4, 64, 96, 5, jnp.float32, jnp.float32, seed=2)

    def body(h, layer):  # chained, as the decoder's layers are
        return jnp.tanh(layer_matmul(h, w, layer)[:, :64]), None

    got, _ = jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(5, dtype=jnp.int32)))(x)
    want = np.asarray(x, np.float64)
    for layer in range(5):
        want = np.tanh(oracle(want, w, layer)[:, :64])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 576, 4099),
        (2, 64, 8),
        (3, 37, 13),
        (4, 64, 40),
        # from 5 rows, w's rows transposed in panels of 32 (edges: w rows, K past 16s)
        (8, 100, 260),
        (16, 16, 33),
        (0, 8, 4),
        (40, 8, 9),
        (64, 576, 1000),
        (9, 40, 70),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transposed_against_float64(m, k, n, dtype):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    got = jax.jit(matmul_transposed)(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    ref = matmul_transposed_reference(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64),
                               rtol=tol, atol=tol)  # fmt: skip


@pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")
def test_transposed_is_native_up_to_its_row_limit_then_xla():
    w = jnp.zeros((40, 16), jnp.float32)
    for m, native_call in (
        (TRANSPOSED_NATIVE_MAX_ROWS, True),
        (TRANSPOSED_NATIVE_MAX_ROWS + 1, False),
    ):
        text = jax.jit(matmul_transposed).lower(jnp.zeros((m, 16), jnp.float32), w).as_text()
        assert ("MatmulTransposed" in text) == native_call, m


def test_rows_past_live_rows_are_zeros_and_the_rest_exact():
    x, w = _arrays(9, 48, 70, 2, jnp.float32, jnp.float32, seed=5)
    x = x.at[5:].set(jnp.nan)  # padding rows may hold anything
    for live in (0, 1, 5):
        got = np.asarray(jax.jit(layer_matmul)(x, w, jnp.int32(1), jnp.int32(live)))
        np.testing.assert_array_equal(got[live:], 0)
        np.testing.assert_allclose(got[:live], oracle(x[:live], w, 1), rtol=2e-5, atol=2e-5)


def test_live_rows_of_both_step_layouts():
    from pagedjax.models.layers import live_rows
    from pagedjax.models.step_input import StepInput

    def step(qsl, lens):
        i = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
        z = i([0] * 8)
        return StepInput(z, z, z, i([[0]] * len(lens)), i(lens), i(qsl), z, max_query_len=1)

    assert int(live_rows(step([0, 1, 2, 3, 4], [5, 9, 0, 0]))) == 2  # decode: row i = seq i
    assert int(live_rows(step([0, 3, 7, 7, 7], [3, 20, 0, 0]))) == 7  # packed prefill
    assert int(live_rows(step([0, 1, 2], [0, 0]))) == 0  # warm-up: no sequence at all


def test_out_of_range_layer_is_clamped_like_xla_indexing():
    x, w = _arrays(2, 16, 32, 3, jnp.float32, jnp.float32, seed=3)
    for layer in (-1, 7):
        got = jax.jit(layer_matmul)(x, w, jnp.int32(layer))
        want = jax.jit(layer_matmul_reference)(x, w, jnp.clip(jnp.int32(layer), 0, 2))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    x, w = _arrays(2, 16, 32, 3, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match=r"\(2, 16\) and \(3, 8, 32\)"):
        layer_matmul(x, w[:, :8], jnp.int32(0))
    with pytest.raises(ValueError, match=r"\(2, 16\) and \(32, 8\)"):
        matmul_transposed(x, w[0, :8].T)
    assert not native_supported(x.astype(jnp.int8), w)


def test_native_off_takes_the_xla_path(monkeypatch):
    x, w = _arrays(3, 32, 48, 2, jnp.float32, jnp.float32)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    hlo = jax.jit(layer_matmul).lower(x, w, jnp.int32(1)).as_text()
    assert "custom_call" not in hlo
    np.testing.assert_allclose(
        np.asarray(jax.jit(layer_matmul)(x, w, jnp.int32(1))), oracle(x, w, 1), rtol=1e-5
    )


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.load("matmul_cpu", SYMBOLS) is None
    assert any("matmul_cpu" in str(w.message) for w in caught)
    x, w = _arrays(3, 32, 48, 2, jnp.float32, jnp.float32)
    got = layer_matmul(x, w, jnp.int32(0))
    np.testing.assert_allclose(np.asarray(got), oracle(x, w, 0), rtol=1e-5)


def test_the_build_is_cached_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    first = native.load("matmul_cpu", SYMBOLS)
    built = sorted(p.name for p in (tmp_path / "native").iterdir())
    # The process's first kernel builds every source the cache lacks, at once (one wait, not
    # one per kernel), and leaves no temporary behind.
    sources = sorted(p.stem for p in native.SOURCE_DIR.glob("*.cc"))
    assert first is not None and first.path.name in built
    assert [name.rsplit("-", 1)[0] for name in built] == sources
    monkeypatch.setattr(native, "_loaded", {})
    again = native.load("matmul_cpu", SYMBOLS)
    assert again.path == first.path and again.target("LayerMatmul") == first.target("LayerMatmul")


_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]")
_SLICE = re.compile(r"dynamic-slice\(%([^,)\s]+)")


def weight_stack_slices(hlo: str, stacks: set[tuple[int, ...]]) -> list[str]:
    """Lines of ``hlo`` that dynamic-slice an operand shaped like one of ``stacks``."""
    shapes = {}
    for line in hlo.splitlines():
        m = _DEF.match(line)
        if m:
            shapes[m[1]] = tuple(int(d) for d in m[2].split(",") if d)
    return [
        line.strip()[:160]
        for line in hlo.splitlines()
        if (m := _SLICE.search(line)) and shapes.get(m[1]) in stacks
    ]


def test_slice_check_sees_a_scanned_kernel():
    """The check below would see the layer scan slicing its stacked kernels (nn.scan's way)."""
    x, w = _arrays(4, 64, 96, 5, jnp.float32, jnp.float32)
    body = lambda h, wl: (jnp.tanh(h @ wl)[:, :64], None)  # noqa: E731
    hlo = jax.jit(lambda x, w: jax.lax.scan(body, x, w)[0]).lower(x, w).compile().as_text()
    assert weight_stack_slices(hlo, {w.shape})


def test_model_step_reads_its_kernels_in_place():
    """The compiled decode step slices no weight stack (the copies XLA makes of a scanned
    slice), and its layer matmuls are the native kernel."""
    from pagedjax.models.config import ModelConfig
    from pagedjax.models.linear import choose_layout
    from pagedjax.models.llama import forward, param_shapes
    from pagedjax.models.step_input import StepInput

    c = ModelConfig("LlamaForCausalLM", 256, 64, 128, 4, 4, 2, 16)
    params = param_shapes(c)
    pool = jax.ShapeDtypeStruct((2, 4 * 32, 8, 16), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    step = StepInput(i32(8), i32(8), i32(8), i32(8, 4), i32(8), i32(9), i32(8), max_query_len=1)
    layout = _in_place(choose_layout(params, c))  # the row-major kernels, read in place
    fn = jax.jit(forward, static_argnums=(3, 4, 5, 6))
    hlo = fn.lower(params, (pool, pool), step, c, "reference", None, layout).compile().as_text()
    stacks = {a.shape for a in jax.tree.leaves(params["layers"]) if a.ndim == 3}
    assert weight_stack_slices(hlo, stacks) == []
    target = native.load("matmul_cpu", SYMBOLS).target("LayerMatmul")
    assert hlo.count(target) >= 7  # q, k, v, o, gate, up, down


@pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")
def test_on_cpu_traces_one_branch_and_lowers_per_platform():
    """``native.on_cpu`` records one equation when traced (neither branch's body), and each
    platform's lowering holds its own branch only: the CPU custom call for a CPU, XLA's dot for
    a GPU, both behind a platform switch for a program lowered for both."""
    x, w = _arrays(4, 64, 32, 2, jnp.float32, jnp.float32)
    calls = {"xla": 0}

    def xla_path(x, w, layer, live):
        calls["xla"] += 1
        return layer_matmul_reference(x, w, layer)

    def native_path(x, w, layer, live):
        return layer_matmul(x, w, layer, live)

    def f(x, w):
        return native.on_cpu(native_path, xla_path, x, w, jnp.int32(1), jnp.int32(4))

    traced = jax.jit(f).trace(x, w)
    assert calls["xla"] == 0
    assert [e.primitive.name for e in traced.jaxpr.eqns] == ["pagedjax_on_cpu"]
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "LayerMatmul" in cpu and "dot_general" not in cpu and calls["xla"] == 0
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "LayerMatmul" not in gpu and "dot_general" in gpu and calls["xla"] == 1
    both = traced.lower(lowering_platforms=("cpu", "cuda")).as_text()
    assert "LayerMatmul" in both and "dot_general" in both
    np.testing.assert_allclose(jax.jit(f)(x, w), oracle(x, w, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")
@pytest.mark.parametrize("m,k,n", [(0, 8, 32), (1, 40, 64), (3, 37, 96), (8, 64, 32), (9, 16, 160)])
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_packed_stack_gives_the_row_major_kernels_bits(m, k, n, w_dtype):
    """A stack packed tile-major multiplies bit for bit as the row-major one (the same sums in
    the same order), for every live row count, and unpacks to itself."""
    x, w = _arrays(max(m, 1), k, n, 3, jnp.float32, w_dtype, seed=m + n)
    x = x[:m]
    packed = pack_stacked(w)
    assert packed.shape == (3, n // 32, k, 32)
    np.testing.assert_array_equal(unpack_stacked(packed), w)
    for layer in (0, 2):
        for live in {0, m // 2, m}:
            want = jax.jit(layer_matmul)(x, w, jnp.int32(layer), jnp.int32(live))
            got = jax.jit(packed_layer_matmul)(x, packed, jnp.int32(layer), jnp.int32(live))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        if m:
            np.testing.assert_allclose(
                packed_layer_matmul_reference(x, packed, layer), oracle(x, w, layer), rtol=2e-2
            )


def test_packing_names_a_width_it_cannot_pack():
    with pytest.raises(ValueError, match=r"multiple of 32, got \(2, 8, 40\)"):
        pack_stacked(jnp.zeros((2, 8, 40)))
    x, w = _arrays(2, 16, 64, 2, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match=r"got \(2, 16\) and \(2, 16, 64\)"):
        packed_layer_matmul(x, w, jnp.int32(0))


@pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_a_packed_table_looks_up_and_multiplies_each_row_alike_at_every_row_count(w_dtype):
    """pack_table holds w [N, K] as [N / 32, K, 32]; packed_take is w[ids] bit for bit, and
    packed_matmul_transposed is x @ w.T (against float64) with each row's bits the same whether
    it is computed alone, among 2-9 rows or among 300 (past the unpacked head's native limit)."""
    n, k = 96, 40
    _, w = _arrays(1, k, n, 1, jnp.float32, w_dtype, seed=7)
    w = w[0].T  # [N, K]
    p = pack_table(w)
    assert p.shape == (n // 32, k, 32)
    np.testing.assert_array_equal(unpack_table(p), w)
    ids = jnp.asarray([0, 31, 32, 95, 5, 5], jnp.int32)
    np.testing.assert_array_equal(jax.jit(packed_take)(p, ids), w[ids])
    x = jnp.asarray(np.random.default_rng(8).standard_normal((300, k)), jnp.float32)
    head = jax.jit(packed_matmul_transposed)
    whole = np.asarray(head(x, p))
    np.testing.assert_allclose(whole, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    for m in range(1, 10):
        np.testing.assert_array_equal(np.asarray(head(x[:m], p)), whole[:m])
    np.testing.assert_allclose(
        np.asarray(jax.jit(matmul_transposed)(x[:9], w)), whole[:9], rtol=1e-5, atol=1e-5
    )


def test_a_table_that_cannot_be_packed_is_named():
    with pytest.raises(ValueError, match=r"multiple of 32, got \(40, 8\)"):
        pack_table(jnp.zeros((40, 8)))
    with pytest.raises(ValueError, match=r"got \(2, 16\) and \(64, 16\)"):
        packed_matmul_transposed(jnp.zeros((2, 16)), jnp.zeros((64, 16)))


def _decode_step(c, num_seqs: int, blocks: int, block_size: int, seed: int):
    from pagedjax.models.step_input import StepInput

    rng = np.random.default_rng(seed)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    lens = rng.integers(1, blocks * block_size + 1, num_seqs)
    tables = np.arange(num_seqs * blocks).reshape(num_seqs, blocks)
    last = lens - 1
    slots = tables[np.arange(num_seqs), last // block_size] * block_size + last % block_size
    return StepInput(
        i32(rng.integers(0, c.vocab_size, num_seqs)),
        i32(lens - 1),
        i32(slots),
        i32(tables),
        i32(lens),
        i32(np.arange(num_seqs + 1)),
        i32(np.arange(num_seqs)),
        max_query_len=1,
    )


def _random_params(c, seed=0):
    from pagedjax.models.llama import param_shapes

    shapes = param_shapes(c)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))
    return jax.tree.map(lambda s: 0.1 * jax.random.normal(next(keys), s.shape, s.dtype), shapes)


def _cpu_layout(params, config):
    """The runner's processing on this CPU: the layers under the scan, the native methods."""
    from pagedjax.models.linear import process_weights_after_loading

    return process_weights_after_loading(params, config, None, "scan", CpuLinearMethods())


def _in_place(layout):
    """``layout`` with every projection read in place row-major and the table as it is (the
    methods of parameters left unpacked)."""
    from pagedjax.models.linear import WeightLayout

    methods = tuple((p, InPlaceLinear() if "/" in p else m) for p, m in layout.methods)
    return WeightLayout(methods, NativeTable())


@pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")
def test_a_model_with_packed_kernels_gives_the_same_logits_and_pool():
    """The CPU's methods pack every layer projection at load; the packed step's logits and KV
    pool are bit for bit the row-major step's. A width that cannot be packed leaves all as they
    are (read in place); parameters packed already come back as they are."""
    from pagedjax.models.config import ModelConfig
    from pagedjax.models.llama import forward, param_shapes

    c = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16)
    params = _random_params(c)
    packed, layout = _cpu_layout(params, c)
    layers = [m for path, m in layout.methods if "/" in path]  # "self_attn/q_proj", ...
    assert set(layers) == {PackedLinear()} and len(layers) == 7
    for group, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))):
        for name in names:
            proj = f"{name}_proj"
            kernel = params["layers"][group][proj]["kernel"]
            np.testing.assert_array_equal(
                unpack_stacked(packed["layers"][group][proj]["kernel"]), kernel
            )
    # untied: the table stays as it is
    assert packed["embed_tokens"]["embedding"] is params["embed_tokens"]["embedding"]
    again, same_layout = _cpu_layout(packed, c)
    assert same_layout == layout
    jax.tree.map(lambda a, b: a is b or pytest.fail("processed twice"), again, packed)
    pool_shape = (2, 2 * 32, 8, 16)  # 32 blocks of 8 slots per layer
    pool = jax.random.normal(jax.random.key(1), pool_shape, jnp.float32)
    step = _decode_step(c, num_seqs=5, blocks=4, block_size=8, seed=2)
    run = jax.jit(forward, static_argnums=(3, 4, 5, 6))
    plain = run(params, (pool, pool + 1), step, c, "reference", None, _in_place(layout))
    fast = run(packed, (pool, pool + 1), step, c, "reference", None, layout)
    np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(plain[0]))
    for a, b in zip(fast[1], plain[1], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    odd = ModelConfig("LlamaForCausalLM", 256, 64, 120, 2, 4, 2, 16)  # MLP width 120
    odd_params = jax.tree.map(jnp.zeros_like, param_shapes(odd))
    same, odd_layout = _cpu_layout(odd_params, odd)
    assert {m for path, m in odd_layout.methods if "/" in path} == {InPlaceLinear()}
    jax.tree.map(lambda a, b: a is b or pytest.fail("changed"), same, odd_params)


@pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")
@pytest.mark.parametrize("vocab", [256, 250])
def test_a_tied_table_is_packed_with_the_layers_when_its_rows_allow(vocab):
    """A tied embedding table of 256 rows is packed with the layers (pack_table) and the packed
    model's logits are the row-major model's up to the head's summation order, a row's bits the
    same at 1 and at 5 sequences; its KV pool is bit for bit the same (the lookup is exact).
    A table of 250 rows stays as it is and the layers are packed alone."""
    import dataclasses

    from pagedjax.models.config import ModelConfig
    from pagedjax.models.llama import forward

    c = dataclasses.replace(
        ModelConfig("LlamaForCausalLM", vocab, 64, 128, 2, 4, 2, 16), tie_word_embeddings=True
    )
    params = _random_params(c, seed=3)
    assert "lm_head" not in params
    packed, layout = _cpu_layout(params, c)
    assert {m for path, m in layout.methods if "/" in path} == {PackedLinear()}
    assert layout.table == (PackedTable() if vocab % 32 == 0 else NativeTable())
    table = packed["embed_tokens"]["embedding"]
    if vocab % 32:
        assert table is params["embed_tokens"]["embedding"]
    else:
        assert table.shape == (vocab // 32, 64, 32)
        np.testing.assert_array_equal(unpack_table(table), params["embed_tokens"]["embedding"])
    pool = jax.random.normal(jax.random.key(1), (2, 2 * 32, 8, 16), jnp.float32)
    step = _decode_step(c, num_seqs=5, blocks=4, block_size=8, seed=4)
    run = jax.jit(forward, static_argnums=(3, 4, 5, 6))
    plain = run(params, (pool, pool + 1), step, c, "reference", None, _in_place(layout))
    fast = run(packed, (pool, pool + 1), step, c, "reference", None, layout)
    np.testing.assert_allclose(np.asarray(fast[0]), np.asarray(plain[0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(fast[1], plain[1], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if vocab % 32 == 0:  # one kernel at every row count (unpacked: dot products up to 4 rows)
        one = jax.tree.map(lambda a: a[:1], step).replace(query_start_loc=step.query_start_loc[:2])
        alone = run(packed, (pool, pool + 1), one, c, "reference", None, layout)
        np.testing.assert_array_equal(np.asarray(alone[0])[0], np.asarray(fast[0])[0])


def test_a_prebuild_compiles_while_the_caller_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_started", {})
    native.prebuild()  # returns at once: the compilers run in the background
    started = dict(native._started)
    sources = sorted(p.stem for p in native.SOURCE_DIR.glob("*.cc"))
    assert sorted(out.name.rsplit("-", 1)[0] for out in started) == sources
    assert all(proc.poll() is None or proc.returncode == 0 for proc, _, _ in started.values())
    lib = native.load("matmul_cpu", SYMBOLS)  # waits for those builds, starts none
    assert lib is not None and lib.path in started and not native._started
    built = sorted(p.name for p in (tmp_path / "native").iterdir())
    assert built == sorted(out.name for out in started)  # no temporary left behind
    native.prebuild()  # loaded already: nothing to start
    assert not native._started


def test_a_prebuild_nobody_waits_for_is_stopped_at_exit(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_started", {})
    native.prebuild()
    procs = [proc for proc, _, _ in native._started.values()]
    assert procs and list((tmp_path / "native").glob(".*.so"))  # their files being written
    native._drop_started()  # what runs at the process's exit
    assert all(proc.returncode is not None for proc in procs)
    assert not list((tmp_path / "native").iterdir()) and not native._started
