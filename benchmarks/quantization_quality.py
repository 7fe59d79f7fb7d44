"""Quantization quality and memory (docs/BENCHMARKS.md, "Quantization").

    .venv/bin/python benchmarks/quantization_quality.py [--model PATH] [--tokens N] [--json]

1. Quality, on the real SmolLM2-135M-Instruct (the embedded GGUF, pagedjax's default model,
   dequantized to float32: the reference): the float32 model greedily continues a few prompts
   (``--tokens`` in all); each quantized setting then scores the same sequences by teacher
   forcing (one prefill, logits at every position, pagedjax.bench.quality) and we report over
   the generated positions the top-1 agreement with the float32 model's next-token choice and
   the mean KL(float32 || quantized). Deterministic on a given machine (no sampling). Settings:
   the engine's weight quantizations, and 8-bit KV *simulated* (K/V written into the float32
   pool as their 8-bit values with a scale per token and KV head: an 8-bit pool is not
   implemented).
2. Memory, without allocating (``jax.eval_shape``): parameter bytes with float32, bfloat16, int8
   and fp8 weights (8-bit: the linear kernels plus their float32 scales; embeddings
   and norms stay in the compute dtype, bfloat16 here), and the KV blocks of 16 tokens a fixed
   budget holds, for SmolLM2 and a Llama-3-8B-shaped config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import numpy as np

PROMPTS = (
    "The history of the printing press begins",
    "Here is a short explanation of how photosynthesis works:",
    "def fibonacci(n):\n    ",
)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
WEIGHT_SETTINGS = ("int8", "fp8", "int8-g64", "int8-g32")  # -gN: a scale per N inputs
BLOCK_SIZE = 16


def quality(model: str, total_tokens: int) -> dict:
    from pagedjax import LLM, SamplingParams
    from pagedjax.bench.quality import compare, teacher_forced_logits
    from pagedjax.worker.runner import Runner

    per_prompt = total_tokens // len(PROMPTS)
    kw = dict(num_blocks=128, block_size=BLOCK_SIZE, max_model_len=512)
    ref = LLM(model, **kw)
    greedy = SamplingParams(max_tokens=per_prompt, temperature=0.0, ignore_eos=True)
    seqs = []
    for out in ref.generate(list(PROMPTS), greedy, use_tqdm=False):
        prompt_ids = list(out.prompt_token_ids)
        seqs.append((len(prompt_ids), prompt_ids + list(out.outputs[0].token_ids)))

    def score(runner) -> list[np.ndarray]:  # the rows before each generated token
        return [teacher_forced_logits(runner, s)[n - 1 : -1] for n, s in seqs]

    ref_logits = np.concatenate(score(ref.runner))
    report = {"model": model, "prompts": len(PROMPTS), "settings": {}}
    for method in WEIGHT_SETTINGS:
        llm = LLM(model, quantization=method, **kw)
        name = f"{method} weights" + ("" if "-g" in method else " (per channel)")
        report["settings"][name] = compare(ref_logits, np.concatenate(score(llm.runner)))
        del llm
    new_runner = lambda params: Runner(ref.model_config, params, **kw)  # noqa: E731
    for method in ("int8", "fp8"):
        with _fake_quant_kv(method):
            logits = score(new_runner(ref.runner.params))
        name = f"{method} KV, per token and head (simulated)"
        report["settings"][name] = compare(ref_logits, np.concatenate(logits))
    return report


@contextlib.contextmanager
def _fake_quant_kv(method: str):
    """K and V written into the pool as their 8-bit values with a symmetric scale per token and
    head (what an 8-bit pool with such scales would read back); the pool stays float32."""
    import jax
    import jax.numpy as jnp

    from pagedjax import pallas_kernels

    qmax = {"int8": 127.0, "fp8": 448.0}[method]

    def fake(x):  # [num_tokens, num_kv_heads, head_dim]
        xf = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / qmax
        scale = jnp.where(scale > 0, scale, 1.0)
        if method == "int8":
            q = jnp.clip(jnp.round(xf / scale), -qmax, qmax)
        else:
            q = (xf / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        return (q * scale).astype(x.dtype)

    write_kv = pallas_kernels.write_kv
    pallas_kernels.write_kv = lambda kp, vp, k, v, slots, **kw: write_kv(
        kp, vp, fake(k), fake(v), slots, **kw
    )
    jax.clear_caches()  # the step programs traced before the patch
    try:
        yield
    finally:
        pallas_kernels.write_kv = write_kv
        jax.clear_caches()


def memory() -> dict:
    from pagedjax.models import quant
    from pagedjax.models.config import ModelConfig
    from pagedjax.models.llama import kv_pool_bytes_per_block, param_shapes
    from pagedjax.models.loader import _open_gguf, default_model_path

    smollm = _open_gguf(Path(default_model_path()))[0]  # the config only: no tensor is read
    configs = {
        "SmolLM2-135M": (smollm, 1.0),
        "Llama-3-8B-shaped": (ModelConfig.from_hf_dict(LLAMA3_8B), 16.0),
    }
    out = {}
    for name, (config, budget_gib) in configs.items():
        params = {
            "float32": quant.param_bytes(param_shapes(config, "float32")),
            "bfloat16": quant.param_bytes(param_shapes(config, "bfloat16")),
        }
        for method in WEIGHT_SETTINGS:
            shapes = quant.quantized_shapes(param_shapes(config, "bfloat16"), method)
            params[method] = quant.param_bytes(shapes)
        blocks = {
            dtype: int(budget_gib * 2**30 // kv_pool_bytes_per_block(config, BLOCK_SIZE, dtype))
            for dtype in ("float32", "bfloat16")
        }
        # Projected, not implemented: 8-bit K/V plus a float32 scale per token and KV head.
        per_block_8bit = 2 * config.num_kv_heads * BLOCK_SIZE * (config.head_dim + 4)
        per_block_8bit *= config.num_layers
        blocks["8-bit + per-token-head f32 scales (projected)"] = int(
            budget_gib * 2**30 // per_block_8bit
        )
        out[name] = {"param_bytes": params, "kv_budget_gib": budget_gib, "kv_blocks": blocks}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--tokens", type=int, default=300, help="generated tokens scored, in all")
    p.add_argument("--json", action="store_true")
    p.add_argument("--memory-only", action="store_true", help="skip the quality runs")
    args = p.parse_args()
    from pagedjax.models.loader import default_model_path

    report = {"memory": memory()}
    if not args.memory_only:
        report["quality"] = quality(args.model or default_model_path(), args.tokens)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    scores = report.get("quality", {"model": "skipped", "settings": {}})
    print(f"quality vs float32 ({scores['model']}):")
    for name, s in scores["settings"].items():
        print(
            f"  {name:44s} top-1 agreement {s['top1']:.4f}  mean KL {s['mean_kl']:.2e}  "
            f"({s['positions']} positions)"
        )
    for name, m in report["memory"].items():
        print(f"{name}:")
        for dtype, n in m["param_bytes"].items():
            print(f"  params {dtype:9s} {n / 2**20:10.1f} MiB")
        for dtype, n in m["kv_blocks"].items():
            print(f"  KV blocks of {BLOCK_SIZE} in {m['kv_budget_gib']:g} GiB, {dtype}: {n}")


if __name__ == "__main__":
    main()
