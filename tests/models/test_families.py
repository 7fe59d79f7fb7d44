"""Model families beyond Llama (Qwen3, Gemma 2/3, Mixtral, Qwen2/3-MoE, Phi-3, OPT, Mistral with
its window): logits and greedy tokens equal to Hugging Face transformers (PyTorch, CPU, float32)
on the same random tiny models (tests/support/hf_models.py FAMILY_CONFIGS).

Fast: every family's config, the logits of one config per mechanism, and Gemma 2 through the
engine with recompute preemption. Slow (``-m slow``): every family's logits, and 32 greedy tokens
for every family, roomy and with preemption.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.extend
import numpy as np
import pytest
import torch
from hf_models import FAMILY_CONFIGS, WINDOW, make_tiny_model, save_tiny_config
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import forward, param_shapes
from pagedjax.models.loader import load_model
from pagedjax.models.step_input import StepInput

from pagedjax import LLM, SamplingParams
from pagedjax.core.window import live_blocks
from pagedjax.worker.runner import Runner, RunnerConfig, ScheduledSeq

BLOCK = 8
# 3 < window < 13; 23 and 40 run past the window (and 40 past Phi-3's original 32-token
# context, so LongRoPE uses its long factors); 16 ends on a block boundary.
PROMPT_LENS = [3, 13, 16, 23, 40]
DECODE_STEPS = 3
RTOL = 1e-4
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


NAMES = sorted(FAMILY_CONFIGS)
# Logits in the fast run: one config per mechanism (the others with -m slow).
FAST_LOGITS = {"gemma2", "gemma3", "mistral_window", "opt_post_norm", "phi3", "qwen2_moe", "qwen3"}


def cases(fast) -> list:
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (directory, HF model, prompts), each tiny model built once per module."""
    models = {}

    def build(name: str):
        if name not in models:
            path = tmp_path_factory.mktemp(name)
            hf = make_tiny_model(name, path)
            rng = np.random.default_rng(len(name))
            prompts = [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]
            models[name] = path, hf, prompts
        return models[name]

    return build


def hf_last_logits(hf, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0, -1].numpy()


def hf_greedy(hf, prompt: list[int], n: int = 32) -> list[int]:
    """HF's own greedy decoding (with its KV cache), EOS never stopping it."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def hf_greedy_cached(hf, prompt: list[int], n: int = 32) -> list[int]:
    """Greedy decoding with HF's forward and its KV cache, one token at a time.

    For Phi-3 this differs from ``hf.generate`` once a sequence grows past the original context:
    generate then drops the cache and re-runs the whole sequence with LongRoPE's long factors
    (Phi3ForCausalLM.prepare_inputs_for_generation), while the cache (HF's, and our pool) keeps
    the keys rotated by the short factors of their time. Re-running such a sequence is the
    engine's to do (models/config.py ``longrope_switch_len``).
    """
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            pos = torch.tensor([[len(prompt) + len(tokens) - 1]])
            out = hf(torch.tensor([tokens[-1:]]), cache=out.past_key_values, position_ids=pos)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("name", NAMES)
def test_config_is_the_family_with_its_details(name, tmp_path):
    save_tiny_config(name, tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    expected = {
        "qwen3": dict(family="qwen3", qk_norm=True, qkv_bias=False, layer_windows=(0, 8, 8)),
        "gemma2": dict(
            family="gemma2",
            layer_windows=(WINDOW, 0, WINDOW, 0),
            attn_soft_cap=5.0,
            final_soft_cap=3.0,
            attn_scale=24**-0.5,
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=True,
            hidden_act="gelu_pytorch_tanh",
        ),
        "gemma3": dict(
            family="gemma3",
            layer_windows=(WINDOW, 0, WINDOW),
            local_rope_layers=(True, False, True),
            rope_theta=100000.0,
            rope_local_theta=1000.0,
            rope_params={"rope_type": "linear", "factor": 2.0},
            qk_norm=True,
            attn_soft_cap=None,
        ),
        "mixtral": dict(family="mixtral", num_experts=4, norm_topk_prob=True),
        "qwen2_moe": dict(
            moe_layers=(True, False, True),
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            qkv_bias=True,
            o_bias=False,
        ),
        "qwen3_moe": dict(moe_layers=(False, True, False, True), qk_norm=True),
        "phi3": dict(rotary_dim=8, max_context_len=512),
        "mistral_window": dict(layer_windows=(WINDOW, WINDOW), max_context_len=512),
        "opt": dict(learned_positions=True, layer_norm=True, norm_before=True, final_norm=True),
        "opt_post_norm": dict(norm_before=False, final_norm=False, word_embed_proj_dim=32),
    }[name]
    for attr, value in expected.items():
        assert getattr(config, attr) == value, attr


def _tables(n: int, total_len: int) -> list[list[int]]:
    """Disjoint, shuffled block tables big enough for total_len tokens per sequence."""
    per = -(-total_len // BLOCK)
    ids = np.random.default_rng(0).permutation(np.arange(1, 1 + per * n))
    return [ids[i * per : (i + 1) * per].tolist() for i in range(n)]


@pytest.mark.parametrize("name", cases(FAST_LOGITS))
def test_prefill_and_decode_logits(name, built):
    path, hf, prompts = built(name)
    loaded = load_model(str(path), use_cache=False)
    runner = Runner(
        loaded.config,
        loaded.params,
        RunnerConfig(num_blocks=64, block_size=BLOCK, max_model_len=64),
    )
    tables = _tables(len(prompts), max(PROMPT_LENS) + DECODE_STEPS)
    # Prefill: all prompts packed into one ragged step; logits at every position.
    logits = runner.forward_logits(
        [ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables, strict=True)], all_positions=True
    )
    errs, refs, row = [], [], 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        errs.append(rel_err(logits[row : row + len(p)], ref))
        assert errs[-1] < RTOL, f"{name} prefill len {len(p)}: rel err {errs[-1]:.2e}"
        refs.append(ref[-1])
        row += len(p)
    # Decode step by step, all sequences batched, feeding HF's greedy choice.
    seqs = [list(p) for p in prompts]
    for step in range(DECODE_STEPS):
        for s, ref in zip(seqs, refs, strict=True):
            s.append(int(ref.argmax()))
        ours = runner.forward_logits(
            [ScheduledSeq([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
        )
        refs = [hf_last_logits(hf, s) for s in seqs]
        for i, ref in enumerate(refs):
            errs.append(rel_err(ours[i], ref))
            assert errs[-1] < RTOL, f"{name} decode step {step} seq {i}: rel err {errs[-1]:.2e}"
    print(f"{name}: max rel logit err {max(errs):.2e}")


def loaded_config(path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))


def _generate(path, prompts, **kwargs):
    llm = LLM(str(path), block_size=BLOCK, max_model_len=128, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_blocks_used == 0
    return [o.outputs[0].token_ids for o in outs], stats


# Phi-3: the scheduler re-runs a sequence once as it grows past LongRoPE's switch length (32), as
# HF's generate does, so both preemption modes match generate.
PREEMPTION = dict(num_blocks=24)
# Mistral's blocks behind its window are freed: 24 blocks hold the whole batch (peak 13), 8 do not.
PREEMPTION_BLOCKS = {"mistral_window": 8}


def _greedy_cases() -> list:
    """(name, preempt): Gemma 2 preempted in the fast run (windows, soft caps, prompts past the
    window, recomputed); every family, roomy and preempted, with -m slow."""
    fast = {("gemma2", True)}
    return [
        (n, p) if (n, p) in fast else pytest.param(n, p, marks=pytest.mark.slow)
        for n in NAMES
        for p in (False, True)
    ]


@pytest.mark.parametrize("name, preempt", _greedy_cases())
def test_greedy_tokens_match_hf_generate(name, preempt, built):
    """Prompts of different lengths decoded together by the engine: the same 32 greedy tokens
    as HF's own generate."""
    path, hf, prompts = built(name)
    kwargs = dict(num_blocks=64)
    if preempt:
        kwargs = dict(PREEMPTION, preemption_mode="recompute")
        kwargs["num_blocks"] = PREEMPTION_BLOCKS.get(name, kwargs["num_blocks"])
    tokens, stats = _generate(path, prompts, **kwargs)
    assert (stats.num_preemptions > 0) == preempt
    for p, ours in zip(prompts, tokens, strict=True):
        assert ours == hf_greedy(hf, p), f"{name} prompt len {len(p)}"


@pytest.mark.parametrize(
    "num_blocks, mode",
    [(8, "recompute"), (64, "recompute"), pytest.param(8, "swap", marks=pytest.mark.slow)],
)
def test_mistral_window_frees_blocks_behind_the_window(num_blocks, mode, built):
    """Window 8, block_size 8: a decode reads at most live_blocks(8, 1, 8) = 2 blocks.

    8 blocks (7 usable, 56 slots) hold less than one sequence of the longest prompt (40 + 32 = 72
    tokens, 9 blocks) and far less than the batch (5 prompts + 32 tokens each: 33 blocks), so it
    runs only by freeing the blocks behind the window, with preemption. 64 blocks: nothing is
    preempted and the peak is the step that prefills all 5 prompts (13 blocks), then 2 per
    decoding sequence, not the 33 that keeping every block would reach. The tokens are HF's."""
    path, hf, prompts = built("mistral_window")
    llm = LLM(
        str(path), block_size=BLOCK, max_model_len=128, num_blocks=num_blocks, preemption_mode=mode
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_blocks_total == num_blocks - 1 and stats.num_blocks_used == 0
    kept_all = sum(-(-(len(p) + 31) // BLOCK) for p in prompts)  # 33: the last step's tables
    assert max(len(p) for p in prompts) + 32 > 7 * BLOCK and kept_all == 33
    if num_blocks == 8:
        assert stats.num_preemptions > 0
    else:
        prefill = sum(-(-len(p) // BLOCK) for p in prompts)  # 13
        decode = len(prompts) * live_blocks(WINDOW, 1, BLOCK)  # 10
        assert stats.num_preemptions == 0 and stats.num_blocks_peak <= max(prefill, decode) == 13
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p), f"prompt len {len(p)}"


def test_phi3_recomputes_once_past_the_longrope_switch(built):
    """Prompts of 3 to 23 tokens grow past Phi-3's switch (32) while decoding: each is re-run
    once with the long factors, and its tokens are HF generate's, not the cached forward's."""
    path, hf, prompts = built("phi3")
    llm = LLM(str(path), block_size=BLOCK, max_model_len=128, num_blocks=64)
    outs = llm.generate(prompts[1:4], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_longrope_recomputes == 3
    differs = 0
    for p, out in zip(prompts[1:4], outs, strict=True):
        ours = out.outputs[0].token_ids
        assert ours == hf_greedy(hf, p), f"prompt len {len(p)}"
        differs += ours != hf_greedy_cached(hf, p)
    assert differs  # the recompute matters: the cached forward's tokens are not generate's


def _count_dots(jaxpr) -> int:
    """dot_general and ragged_dot equations, and native CPU kernel calls (``native.on_cpu``:
    one equation each, whose branches lower per platform), in sub-jaxprs (scan bodies, conds)
    too."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in ("dot_general", "ragged_dot_general", "pagedjax_on_cpu")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _count_dots(sub)
    return n


@pytest.mark.parametrize("name", ["gemma3", "qwen2_moe"])
def test_layers_stay_under_scan(name, tmp_path):
    """Per-layer differences (windows, rope tables, MoE or dense MLPs) are scanned data: the
    traced program holds one copy of the layer whatever the depth."""
    counts = []
    for layers in (3, 9):
        types = ["sliding_attention", "full_attention", "sliding_attention"] * (layers // 3)
        extra = dict(layer_types=types) if name == "gemma3" else dict(mlp_only_layers=[1, 4])
        save_tiny_config(name, tmp_path / str(layers), num_hidden_layers=layers, **extra)
        d = json.loads((tmp_path / str(layers) / "config.json").read_text())
        c = ModelConfig.from_hf_dict(d)
        pool = jax.ShapeDtypeStruct((c.num_kv_heads, layers * 4, BLOCK, c.head_dim), np.float32)
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=np.int32)
        step = StepInput(
            i32((8,)), i32((8,)), i32((8,)), i32((2, 2)), i32((2,)), i32((3,)), i32((2,)),
            max_query_len=4,
        )  # fmt: skip
        fn = functools.partial(forward, config=c, backend="reference")
        counts.append(_count_dots(jax.make_jaxpr(fn)(param_shapes(c), (pool, pool), step).jaxpr))
    assert counts[0] == counts[1] > 0
