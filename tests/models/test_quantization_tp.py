"""Quantized weights under tensor parallelism: tiny Llama int8 (per channel and in groups of 32)
with tensor_parallel_size 1, 2 and 4 (4 > its 2 KV heads: the k/v kernels and their scales are
replicated) on 4 virtual CPU devices (in a subprocess: XLA_FLAGS). Scales are split like their
kernels' output axis, or like the kernel when grouped."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from worker_report import run_reporting_worker

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests/support"]
    import jax
    from hf_models import make_tiny_model
    from pagedjax import LLM, SamplingParams

    path = sys.argv[1]
    make_tiny_model(sys.argv[4], __import__("pathlib").Path(path))
    prompts = [[5, 9, 33, 2, 71, 8], [100, 4, 7]]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    report = {}
    runs = json.loads(sys.argv[3])
    for method, tp in runs:
        llm = LLM(path, quantization=method, tensor_parallel_size=tp, num_blocks=32,
                  block_size=8, max_model_len=64)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        attn = llm.runner.params["layers"]["self_attn"]
        report[f"{method} {tp}"] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "q_scale_spec": str(getattr(attn["q_proj"]["kernel_scale"].sharding, "spec", None)),
            "o_scale_spec": str(getattr(attn["o_proj"]["kernel_scale"].sharding, "spec", None)),
            "k_scale_spec": str(getattr(attn["k_proj"]["kernel_scale"].sharding, "spec", None)),
            "q_dtype": str(attn["q_proj"]["kernel"].dtype),
        }
        if "moe" in llm.runner.params:
            experts = llm.runner.params["moe"]["experts"]
            report[f"{method} {tp}"]["expert_dtype"] = str(experts["gate_proj"].dtype)
    print("REPORT " + json.dumps(report))
    """
)


def _report(tmp_path, runs: list[tuple[str, int]], model: str = "llama_gqa") -> dict:
    argv = ["-c", WORKER, str(tmp_path / "tiny"), str(ROOT), json.dumps(runs), model]
    return run_reporting_worker(argv, num_devices=4, timeout=900)


def test_int8_tensor_parallel_matches_tp_1(tmp_path):
    runs = [("int8", 1), ("int8", 2), ("int8", 4), ("int8-g32", 1), ("int8-g32", 2)]
    report = _report(tmp_path, runs)
    assert report["int8 2"]["tokens"] == report["int8 1"]["tokens"]
    assert report["int8 4"]["tokens"] == report["int8 1"]["tokens"]
    assert report["int8 2"]["q_dtype"] == "int8"
    assert report["int8 2"]["q_scale_spec"] == "P(None, 'tp')"  # per channel: [layers, out]
    assert report["int8 2"]["o_scale_spec"] == "P()"
    assert report["int8-g32 2"]["tokens"] == report["int8-g32 1"]["tokens"]
    assert report["int8-g32 2"]["q_scale_spec"] == "P(None, None, 'tp')"  # [layers, groups, out]
    assert report["int8-g32 2"]["o_scale_spec"] == "P(None, 'tp', None)"  # groups of inputs


@pytest.mark.slow
def test_grouped_int8_at_tensor_parallel_4_matches_tp_1(tmp_path):
    report = _report(tmp_path, [("int8-g32", 1), ("int8-g32", 4)])
    # TP 4: o_proj's 64 inputs split 16 per device, but its 2 groups of 32 do not divide by 4,
    # so its scales are replicated (a group spans two devices' rows); the tokens still agree.
    assert report["int8-g32 4"]["tokens"] == report["int8-g32 1"]["tokens"]
    assert report["int8-g32 4"]["q_scale_spec"] == "P(None, None, 'tp')"
    assert report["int8-g32 4"]["o_scale_spec"] == "P()"
    assert report["int8-g32 4"]["k_scale_spec"] == "P(None, None, 'tp')"  # KV heads widened to 4


@pytest.mark.slow
def test_int8_moe_experts_at_tensor_parallel_2_and_4_match_tp_1(tmp_path):
    """Qwen2-MoE's int8 experts under the shard_map that splits every expert's inner dimension:
    gate/up scales split with their columns, down's scales whole."""
    report = _report(tmp_path, [("int8", 1), ("int8", 2), ("int8", 4)], model="qwen2_moe")
    assert report["int8 1"]["expert_dtype"] == "int8"
    assert report["int8 2"]["tokens"] == report["int8 1"]["tokens"]
    assert report["int8 4"]["tokens"] == report["int8 1"]["tokens"]
