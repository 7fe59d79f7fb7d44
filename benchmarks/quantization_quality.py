"""Quantization quality and memory (docs/BENCHMARKS.md, "Quantization").

    .venv/bin/python benchmarks/quantization_quality.py [--model PATH] [--tokens N] [--json]

1. Quality, on the real SmolLM2-135M-Instruct (the embedded GGUF, pagedjax's default model,
   dequantized to float32: the reference): the float32 model greedily continues a few prompts
   (``--tokens`` in all); each quantized setting then scores the same sequences by teacher
   forcing (one prefill, logits at every position, pagedjax.bench.quality) and we report over
   the generated positions the top-1 agreement with the float32 model's next-token choice and
   the mean KL(float32 || quantized). Deterministic on a given machine (no sampling). Settings:
   the engine's weight quantizations, and its 8-bit KV caches (``kv_cache_dtype="int8"`` /
   ``"fp8"``: float32 weights, K/V stored as int8 / float8_e4m3fn pages with a float32 scale per
   token and KV head, and the prefill's attention reads them back from the pool).
2. Memory, without allocating (``jax.eval_shape``): parameter bytes with float32, bfloat16, int8
   and fp8 weights (8-bit: the linear kernels plus their float32 scales; embeddings
   and norms stay in the compute dtype, bfloat16 here), and the KV blocks of 16 tokens a fixed
   budget holds with float32, bfloat16, int8 and fp8 pools (``kv_pool_bytes_per_block``: 8-bit
   pages plus their float32 scales), for SmolLM2 and a Llama-3-8B-shaped config.
"""

from __future__ import annotations

import argparse
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
# (kv_cache_dtype, compute dtype): float32 and bfloat16 pools ("auto"), then the 8-bit ones
KV_SETTINGS = (("auto", "float32"), ("auto", "bfloat16"), ("int8", None), ("fp8", None))


def quality(model: str, total_tokens: int) -> dict:
    from pagedjax import LLM, SamplingParams
    from pagedjax.bench.quality import compare, teacher_forced_logits
    from pagedjax.worker.runner import Runner, RunnerConfig

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
    for kv_cache_dtype in ("int8", "fp8"):  # the reference's float32 weights, an 8-bit pool
        sizes = RunnerConfig(kv_cache_dtype=kv_cache_dtype, **kw)
        runner = Runner(ref.model_config, ref.runner.params, sizes)
        name = f"{kv_cache_dtype} KV cache (scale per token and head)"
        report["settings"][name] = compare(ref_logits, np.concatenate(score(runner)))
        runner.free_device_memory()
    return report


def memory() -> dict:
    from pagedjax.models import quant
    from pagedjax.models.config import ModelConfig
    from pagedjax.models.llama import kv_pool_bytes_per_block, param_shapes
    from pagedjax.models.loader import default_model_path
    from pagedjax.models.loading.gguf import open_gguf

    from pagedjax.worker.kv_cache import pool_dtype

    smollm = open_gguf(Path(default_model_path()))[0]  # the config only: no tensor is read
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
        blocks = {}
        for kv_cache_dtype, compute in KV_SETTINGS:
            dtype = pool_dtype(kv_cache_dtype, compute)
            per_block = kv_pool_bytes_per_block(config, BLOCK_SIZE, dtype)
            blocks[str(dtype)] = int(budget_gib * 2**30 // per_block)
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
