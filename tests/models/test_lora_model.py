"""LoRA adapters in the model (models/lora.py, models/lora_slots.py): PEFT adapters loaded into
device slots, and a batch whose rows use different adapters (and none) giving, row by row, the
logits of transformers + PEFT with that row's adapter merged into a copy of the base model.

Tiny random Llama, Qwen2, Gemma 2 and Phi-3 models (tests/support/hf_models.py); three adapters
each, of different ranks, scalings and targets, their B matrices random (PEFT starts B at zero).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from hf_models import make_tiny_model
from jax.sharding import PartitionSpec as P
from pagedjax.models.config import ModelConfig
from pagedjax.models.layer_loop import split_layers
from pagedjax.models.llama import forward, param_shapes
from pagedjax.models.loader import load_model
from pagedjax.models.lora import (
    LoRABatch,
    init_slots,
    load_adapter,
    set_slot,
)
from pagedjax.models.step_input import StepInput
from peft_adapters import save_random_adapter
from worker_report import run_reporting_worker

from pagedjax import compilation
from pagedjax.lora import LoRAConfig
from pagedjax.worker.runner import Runner, RunnerConfig, ScheduledSeq

BLOCK = 8
RTOL = 1e-4
MAX_RANK = 16
PROMPT_LENS = [3, 13, 16, 23, 9]
PROMPT_SLOTS = [1, 0, 3, 2, 1]  # every slot, the base model's (0) among them
FAMILIES = ["llama_gqa", "qwen2_bias", "gemma2", "phi3", "opt"]
_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_PHI3_NAMES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_PHI3_NAMES |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_OPT_NAMES = {"o_proj": "out_proj", "gate_proj": None, "up_proj": "fc1", "down_proj": "fc2"}
# Slots 1..3: (rank, alpha, rslora, targets, layers or None for all).
ADAPTERS = [
    (4, 8, False, ["q_proj", "v_proj"], None),
    (8, 32, True, _ALL, None),
    (16, 16, False, ["o_proj", "gate_proj", "down_proj"], [1]),
]
_forward = jax.jit(forward, static_argnums=(3, 4, 5, 6))


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def targets(name: str, modules: list[str]) -> list[str]:
    """PEFT's target names on this model: Phi-3's fused projections, OPT's names (no gate)."""
    names = {"phi3": _PHI3_NAMES, "opt": _OPT_NAMES}.get(name, {})
    return sorted({names.get(m, m) for m in modules} - {None})


def make_adapter(hf, name: str, spec, directory, seed: int):
    """Save a PEFT adapter with random A and B on a copy of ``hf``; returns the merged model."""
    rank, alpha, rslora, modules, layers = spec
    return save_random_adapter(
        hf,
        directory,
        seed,
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets(name, modules),
        layers_to_transform=layers,
    )


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (base dir, HF models by slot (0: the base), adapter dirs for slots 1..3)."""
    built = {}

    def build(name: str):
        if name not in built:
            root = tmp_path_factory.mktemp(f"lora_{name}")
            hf = make_tiny_model(name, root / "base")
            models, dirs = [hf], []
            for i, spec in enumerate(ADAPTERS, start=1):
                dirs.append(root / f"adapter{i}")
                models.append(make_adapter(hf, name, spec, dirs[-1], seed=i))
            built[name] = root / "base", models, dirs
        return built[name]

    return build


def hf_logits(hf, seq: list[int]) -> np.ndarray:  # [len(seq), vocab]
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].numpy()


def _tables(n: int, total_len: int) -> list[list[int]]:
    per = -(-total_len // BLOCK)
    ids = np.random.default_rng(0).permutation(np.arange(1, 1 + per * n))
    return [ids[i * per : (i + 1) * per].tolist() for i in range(n)]


class LoRARunner:
    """Our model's forward on a Runner's parameters, pool and step inputs, with adapters."""

    def __init__(self, base_dir, adapter_dirs, quantization=None, params=None, dtype="float32"):
        """``params``: these instead of the checkpoint's (in its config)."""
        loaded = load_model(str(base_dir), dtype, use_cache=False, quantization=quantization)
        params = loaded.params if params is None else params
        sizes = RunnerConfig(num_blocks=64, block_size=BLOCK, max_model_len=64)
        self.runner = Runner(loaded.config, params, sizes)
        self.config = loaded.config
        self.slots = init_slots(self.config, len(adapter_dirs), MAX_RANK, self.runner.dtype)
        self.adapters = [load_adapter(str(d), self.config, MAX_RANK) for d in adapter_dirs]
        for slot, adapter in enumerate(self.adapters, start=1):
            self.slots = set_slot(self.slots, slot, adapter)

    def logits(self, seqs: list[ScheduledSeq], row_slots, pool, lora=True, all_rows=False):
        """(logits of every scheduled row or each sequence's last, pool after the step).
        ``row_slots``: each scheduled row's slot."""
        r = self.runner
        step = r.build_step_input(seqs)
        lengths = np.asarray([len(s.token_ids) for s in seqs])
        rows = np.arange(lengths.sum()) if all_rows else np.cumsum(lengths) - 1
        step = step.replace(logits_indices=rows.astype(np.int32))
        token_slot = np.zeros(step.token_ids.shape, np.int32)  # padding rows: no adapter
        token_slot[: len(row_slots)] = row_slots
        batch = LoRABatch(self.slots, jnp.asarray(token_slot)) if lora else None
        logits, pool = _forward(
            r.params, pool, step, self.config, r.backend, r.mesh, r.linear, batch
        )
        return np.asarray(logits), pool


def model_config(base_dir) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((base_dir / "config.json").read_text()))


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("name", FAMILIES)
def test_mixed_adapters_match_peft_merged(name, family):
    """Prefill of five prompts, one ragged step whose rows use slots 1, 0, 3, 2, 1, then two
    decode steps: each row's logits are transformers' with that row's adapter merged. The base
    model's rows equal a step without LoRA bit for bit."""
    base_dir, models, dirs = family(name)
    ours = LoRARunner(base_dir, dirs)
    prompts = _prompts(len(name))
    tables = _tables(len(prompts), max(PROMPT_LENS) + 2)
    seqs = [ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    row_slots = np.repeat(PROMPT_SLOTS, PROMPT_LENS)
    pool0 = ours.runner.kv_cache.pages
    base, _ = ours.logits(seqs, row_slots, pool0, lora=False, all_rows=True)
    logits, pool = ours.logits(seqs, row_slots, pool0, all_rows=True)
    starts = np.cumsum([0, *PROMPT_LENS])
    refs = []
    for i, (p, slot) in enumerate(zip(prompts, PROMPT_SLOTS, strict=True)):
        rows = slice(starts[i], starts[i + 1])
        ref = hf_logits(models[slot], p)
        err = rel_err(logits[rows], ref)
        assert err < RTOL, f"{name} prompt {i} slot {slot}: rel err {err:.2e}"
        if slot == 0:
            np.testing.assert_array_equal(logits[rows], base[rows])
        else:  # the adapter matters: the base model's logits are far off
            assert rel_err(base[rows], ref) > 100 * RTOL
        refs.append(ref[-1])
    for step in range(2):
        for s, ref in zip(prompts, refs, strict=True):
            s.append(int(ref.argmax()))
        seqs = [ScheduledSeq([s[-1]], len(s) - 1, t) for s, t in zip(prompts, tables, strict=True)]
        logits, pool = ours.logits(seqs, PROMPT_SLOTS, pool)
        refs = [
            hf_logits(models[slot], s)[-1] for s, slot in zip(prompts, PROMPT_SLOTS, strict=True)
        ]
        for i, ref in enumerate(refs):
            err = rel_err(logits[i], ref)
            assert err < RTOL, f"{name} decode {step} seq {i}: rel err {err:.2e}"


def test_adapters_as_loaded(family):
    """Ranks, scalings (alpha / r, alpha / sqrt(r) with rslora) and our module names; Phi-3's
    fused qkv_proj and gate_up_proj become q/k/v and gate/up, sharing A and splitting B."""
    base_dir, _, dirs = family("phi3")
    config = model_config(base_dir)
    adapters = [load_adapter(str(d), config, MAX_RANK) for d in dirs]
    assert [a.rank for a in adapters] == [4, 8, 16]
    assert [a.scaling for a in adapters] == pytest.approx([2.0, 32 / 8**0.5, 1.0])
    assert adapters[0].target_modules == {"q_proj", "k_proj", "v_proj"}
    assert adapters[1].target_modules == set(_ALL)
    assert adapters[2].target_modules == {"o_proj", "gate_proj", "up_proj", "down_proj"}
    q_a, q_b = adapters[0].weights["q_proj"]
    k_a, k_b = adapters[0].weights["k_proj"]
    np.testing.assert_array_equal(q_a, k_a)
    assert q_b.shape[2] == config.num_heads * config.head_dim
    assert k_b.shape[2] == config.num_kv_heads * config.head_dim
    gate_a, _ = adapters[2].weights["gate_proj"]
    assert not gate_a[0].any() and gate_a[1].any()  # layers_to_transform=[1]
    assert adapters[1].nbytes() > adapters[0].nbytes() > 0


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_families_adapt_attention(name, tmp_path):
    """A MoE family's attention projections take adapters (its experts do not): rows with the
    adapter and without it in one step, each equal to transformers + PEFT's."""
    hf = make_tiny_model(name, tmp_path / "base")
    spec = (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"], None)
    merged = make_adapter(hf, name, spec, tmp_path / "adapter", seed=5)
    ours = LoRARunner(tmp_path / "base", [tmp_path / "adapter"])
    prompts = _prompts(4)[1:3]
    seqs = [ScheduledSeq(p, 0, [2 * i + 1, 2 * i + 2]) for i, p in enumerate(prompts)]
    rows = np.repeat([1, 0], [len(p) for p in prompts])
    logits, _ = ours.logits(seqs, rows, ours.runner.kv_cache.pages, all_rows=True)
    n = len(prompts[0])
    assert rel_err(logits[:n], hf_logits(merged, prompts[0])) < RTOL
    assert rel_err(logits[n:], hf_logits(hf, prompts[1])) < RTOL
    assert rel_err(logits[:n], hf_logits(hf, prompts[0])) > 100 * RTOL


def test_adapter_saved_as_bin_loads_the_same(family, tmp_path):
    """adapter_model.bin (PyTorch's format) gives the safetensors file's weights."""
    from safetensors.torch import load_file

    base_dir, _, dirs = family("llama_gqa")
    (tmp_path / "bin").mkdir()
    shutil.copy(dirs[1] / "adapter_config.json", tmp_path / "bin")
    torch.save(
        load_file(str(dirs[1] / "adapter_model.safetensors")),
        tmp_path / "bin" / "adapter_model.bin",
    )
    config = model_config(base_dir)
    ref, ours = (load_adapter(str(d), config, MAX_RANK) for d in (dirs[1], tmp_path / "bin"))
    assert ours.target_modules == ref.target_modules and ours.scaling == ref.scaling
    for m, (a, b) in ref.weights.items():
        np.testing.assert_array_equal(ours.weights[m][0], a)
        np.testing.assert_array_equal(ours.weights[m][1], b)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_bad_adapters_are_refused_naming_the_value(family, tmp_path):
    base_dir, models, dirs = family("llama_gqa")
    config = model_config(base_dir)
    load = lambda d, c=config, r=MAX_RANK: load_adapter(str(d), c, r)  # noqa: E731
    with pytest.raises(ValueError, match="nowhere"):
        load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        load(tmp_path / "empty")
    (tmp_path / "no_weights").mkdir()
    shutil.copy(dirs[0] / "adapter_config.json", tmp_path / "no_weights")
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load(tmp_path / "no_weights")
    with pytest.raises(ValueError, match="r=16 exceeds max_lora_rank=8"):
        load(dirs[2], r=8)
    for option, value in [
        ("use_dora", True),
        ("bias", "lora_only"),
        ("modules_to_save", ["lm_head"]),
        ("peft_type", "IA3"),
        ("alpha_pattern", {"q_proj": 4}),
    ]:
        bad = _copy_with_config(dirs[0], tmp_path / option, **{option: value})
        with pytest.raises(ValueError, match=f"{option}.*{value!r}".replace("[", r"\[")):
            load(bad)
    # An embedding adapter (PEFT's lora_embedding_A/B) is refused by its tensor's name.
    embed = peft.get_peft_model(
        copy.deepcopy(models[0]), peft.LoraConfig(r=4, target_modules=["embed_tokens"])
    )
    embed.save_pretrained(str(tmp_path / "embed"))
    with pytest.raises(ValueError, match="embed_tokens.lora_embedding_A"):
        load(tmp_path / "embed")
    # Another model's modules, shapes or depth.
    phi3 = dataclasses.replace(config, architecture="Phi3ForCausalLM")
    with pytest.raises(ValueError, match="'self_attn.q_proj'.*Phi3ForCausalLM"):
        load(dirs[0], phi3)
    wider = dataclasses.replace(config, hidden_size=96)
    with pytest.raises(ValueError, match=r"q_proj of layer 0 has lora_A \(4, 64\)"):
        load(dirs[0], wider)
    with pytest.raises(ValueError, match="layer 1; the model has 1 layers"):
        load(dirs[0], dataclasses.replace(config, num_layers=1))
    # A MoE family's experts are not adapted: an MLP adapter is refused, attention is fine.
    moe = dataclasses.replace(
        config,
        architecture="MixtralForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    with pytest.raises(ValueError, match="'mlp.down_proj'"):
        load(dirs[1], moe)
    assert load(dirs[0], moe).target_modules == {"q_proj", "v_proj"}
    slots = init_slots(config, 2, 4, jnp.float32)
    with pytest.raises(ValueError, match="slot must be in \\[1, 2\\], got 3"):
        set_slot(slots, 3, None)
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank 4"):
        set_slot(slots, 1, load(dirs[1]))
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1, got 0"):
        LoRAConfig(max_loras=0)


def test_changing_slots_compiles_nothing(family):
    """set_slot writes any adapter into any slot (or clears it) with one program, and the step
    reads the new slots without compiling: the slot is a traced index, the shapes fixed."""
    base_dir, models, dirs = family("llama_gqa")
    ours = LoRARunner(base_dir, dirs)  # slots 1..3 set: set_slot compiled once
    compilation.track_compile_seconds()
    seqs = [ScheduledSeq(p, 0, [i + 1, i + 9]) for i, p in enumerate(_prompts(0)[:2])]
    rows = [1] * PROMPT_LENS[0] + [2] * PROMPT_LENS[1]
    pool = ours.runner.kv_cache.pages
    before, _ = ours.logits(seqs, rows, pool)
    compiled = compilation.programs_compiled()
    a = ours.adapters
    slots = set_slot(ours.slots, 1, a[2])  # rank 16 over rank 4
    slots = set_slot(slots, 2, None)
    slots = set_slot(slots, 3, a[0])
    ours.slots = slots
    after, _ = ours.logits(seqs, [3] * PROMPT_LENS[0] + [1] * PROMPT_LENS[1], pool)
    assert compilation.programs_compiled() == compiled
    # Slot 3 now computes what slot 1 did; slot 1 holds the third adapter, scaled.
    np.testing.assert_array_equal(after[0], before[0])
    ref = hf_logits(models[3], _prompts(0)[1])[-1]
    assert rel_err(after[1], ref) < RTOL
    assert not np.asarray(slots.a["q_proj"][:, 2]).any()
    wa, wb = a[2].weights["o_proj"]
    np.testing.assert_array_equal(np.asarray(slots.a["o_proj"][:, 1]), wa)
    np.testing.assert_allclose(np.asarray(slots.b["o_proj"][:, 1]), wb * a[2].scaling, rtol=1e-6)


def test_unrolled_layers_and_int8_weights(family, monkeypatch):
    """The adapters over one parameter tree per layer (every platform but a CPU), and over
    int8 kernels (the product is added to the quantized method's)."""
    base_dir, models, dirs = family("qwen2_bias")
    prompt = _prompts(1)[3]
    seqs = [ScheduledSeq(prompt, 0, [1, 2, 3])]
    monkeypatch.setenv("PAGEDJAX_LAYER_LOOP", "unrolled")
    ours = LoRARunner(base_dir, dirs)
    assert isinstance(ours.runner.params["layers"], tuple)
    for slot in (0, 2):
        logits, _ = ours.logits(
            seqs, [slot] * len(prompt), ours.runner.kv_cache.pages, all_rows=True
        )
        assert rel_err(logits, hf_logits(models[slot], prompt)) < RTOL
    monkeypatch.delenv("PAGEDJAX_LAYER_LOOP")
    # int8 kernels (a scale per output column) against float kernels of the same values.
    params = load_model(str(base_dir), use_cache=False, quantization="int8").params
    quantized = LoRARunner(base_dir, dirs, quantization="int8")
    same_values = LoRARunner(base_dir, dirs, params=dequantized(params))
    assert "ColumnQuantLinear" in repr(quantized.runner.linear)
    for slot in (0, 2):
        rows = [slot] * len(prompt)
        ref, _ = same_values.logits(seqs, rows, same_values.runner.kv_cache.pages, all_rows=True)
        logits, _ = quantized.logits(seqs, rows, quantized.runner.kv_cache.pages, all_rows=True)
        assert rel_err(logits, ref) < RTOL
    assert rel_err(ref, hf_logits(models[2], prompt)) < 0.1  # int8's own error, loosely


def test_bfloat16_weights_and_slots(family):
    """bfloat16 weights, slots and products: each prompt's rows near its merged model's (the
    float32 oracle), far from the others'."""
    base_dir, models, dirs = family("llama_gqa")
    ours = LoRARunner(base_dir, dirs, dtype="bfloat16")
    assert ours.slots.a["q_proj"].dtype == jnp.bfloat16
    prompts = _prompts(3)[:4]
    seqs = [ScheduledSeq(p, 0, [2 * i + 1, 2 * i + 2]) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    logits, _ = ours.logits(
        seqs, np.repeat([0, 1, 2, 3], lens), ours.runner.kv_cache.pages, all_rows=True
    )
    starts = np.cumsum([0, *lens])
    for slot, p in enumerate(prompts):
        rows = logits[starts[slot] : starts[slot + 1]]
        assert rel_err(rows, hf_logits(models[slot], p)) < 0.1  # bfloat16 rounding
        assert rel_err(rows, hf_logits(models[(slot + 1) % 4], p)) > 0.3


def dequantized(params):
    """Every int8 kernel with its per-column scale as a float kernel of the same values."""
    if not isinstance(params, dict):
        return params
    if "kernel_scale" not in params:
        return {k: dequantized(v) for k, v in params.items()}
    kernel = (
        np.asarray(params["kernel"], np.float32) * np.asarray(params["kernel_scale"])[..., None, :]
    )
    rest = {k: v for k, v in params.items() if k not in ("kernel", "kernel_scale")}
    return {**rest, "kernel": jnp.asarray(kernel)}


@pytest.mark.slow  # three runners in a subprocess: about 35 s
def test_tensor_parallel_slots_split_as_their_projections(family):
    """Tensor parallel degrees 2 and 4 (over 2 KV heads: replicated, k/v adapters widened with
    them) give degree 1's logits, which are transformers + PEFT's; the slots are split as
    their base projections are, and set_slot keeps them so."""
    base_dir, models, dirs = family("llama_gqa")
    worker = Path(__file__).with_name("lora_tp_worker.py")
    argv = [str(worker), str(base_dir), ",".join(str(d) for d in dirs)]
    report = run_reporting_worker(argv, num_devices=4, timeout=600)
    one = np.asarray(report["1"]["logits"])
    starts = np.cumsum([0, *(len(p) for p in report["prompts"])])
    for i, (p, slot) in enumerate(zip(report["prompts"], report["slots"], strict=True)):
        assert rel_err(one[starts[i] : starts[i + 1]], hf_logits(models[slot], p)) < RTOL
    for tp in ("2", "4"):
        assert rel_err(np.asarray(report[tp]["logits"]), one) < RTOL, f"tp={tp}"
        assert report[tp]["kept_shardings"]
        specs = report[tp]["specs"]
        whole, split_in, split_out = (
            str(P()),
            str(P(None, None, "tp", None)),
            str(P(*[None] * 3, "tp")),
        )
        assert specs["a/q_proj"] == specs["a/gate_proj"] == specs["b/o_proj"] == whole
        assert specs["b/q_proj"] == specs["b/k_proj"] == specs["b/up_proj"] == split_out
        assert specs["a/o_proj"] == specs["a/down_proj"] == split_in
    # Device 0's share: q's B [layers, slots, rank, 64 / tp], o's A [layers, slots, 64 / tp, rank];
    # at tp=4 the k projection's 4 replicated heads of 16 put one head (16 columns) on each.
    assert report["2"]["device0_shapes"]["b/q_proj"] == [2, 4, 16, 32]
    assert report["4"]["device0_shapes"]["a/o_proj"] == [2, 4, 16, 16]
    assert report["4"]["device0_shapes"]["b/k_proj"] == [2, 4, 16, 16]


def _count_dots(jaxpr) -> int:
    """dot_general equations, in sub-jaxprs (the scan's body) too."""
    subs = [sub for eqn in jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
    own = sum(eqn.primitive.name == "dot_general" for eqn in jaxpr.eqns)
    return own + sum(_count_dots(sub) for sub in subs)


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_lora_ops_only_with_an_adapter_batch(loop, family):
    """Without ``lora`` the program holds the base model's dots only; with it, per adapted
    projection of each traced layer, one x @ a over every slot and one @ b per adapter slot
    (each row selects its own slot's product: lora_delta)."""
    base_dir, _, _ = family("llama_gqa")
    c = model_config(base_dir)
    params = param_shapes(c)
    if loop == "unrolled":
        params = split_layers(params, c)
    pages = jax.ShapeDtypeStruct((c.num_kv_heads, 2 * c.num_layers, BLOCK, c.head_dim), np.float32)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=np.int32)
    step = StepInput(
        i32((8,)), i32((8,)), i32((8,)), i32((2, 2)), i32((2,)), i32((3,)), i32((2,)),
        max_query_len=4,
    )  # fmt: skip
    slots = jax.eval_shape(lambda: init_slots(c, 2, 16, jnp.float32))

    def dots(*args, **kwargs) -> int:
        def fn(params, pool, step, lora=None):
            return forward(params, pool, step, c, "reference", lora=lora)

        return _count_dots(jax.make_jaxpr(functools.partial(fn, **kwargs))(*args).jaxpr)

    base = dots(params, (pages, pages), step)
    with_lora = dots(params, (pages, pages), step, LoRABatch(slots, i32((8,))))
    layers = c.num_layers if loop == "unrolled" else 1
    assert dots(params, (pages, pages), step, lora=None) == base > 0
    max_loras = 2
    assert with_lora == base + (1 + max_loras) * 7 * layers
