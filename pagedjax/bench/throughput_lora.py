"""Random LoRA adapters for ``pagedjax bench throughput --num-loras N``: each saved as PEFT saves
one (``adapter_config.json`` and ``adapter_model.safetensors``, A [r, in] and B [out, r] for
every projection an adapter may target in the model), so the LoRA run reads them through the
same loader as real adapters. Their values only need to be finite: the workload ignores EOS, so
every request produces its full output length whatever the adapter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedjax.models.lora_slots import ATTENTION_MODULES, lora_modules, module_dims


def random_adapters(model_config, num: int, rank: int, directory: Path, seed: int = 0) -> list:
    """``num`` random adapters of rank ``rank`` under ``directory``, as LoRARequests (ids 1..)."""
    from safetensors.numpy import save_file

    from pagedjax.lora.request import LoRARequest

    if model_config.family in ("opt", "phi3"):  # other module names or fused projections
        raise ValueError(f"--num-loras: no random adapters for {model_config.family} models")
    dims = module_dims(model_config)
    modules = lora_modules(model_config)
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(1, num + 1):
        tensors = {}
        for layer in range(model_config.num_layers):
            for name in modules:
                n_in, n_out = dims[name]
                where = "self_attn" if name in ATTENTION_MODULES else "mlp"
                key = f"base_model.model.model.layers.{layer}.{where}.{name}"
                a = rng.standard_normal((rank, n_in), np.float32) / np.sqrt(n_in)
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = 0.01 * rng.standard_normal(
                    (n_out, rank), np.float32
                )
        path = Path(directory) / f"adapter{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(modules),
        }
        (path / "adapter_config.json").write_text(json.dumps(config))
        requests.append(LoRARequest(f"adapter{i}", i, str(path)))
    return requests


def lora_options(spec: dict) -> dict:
    """The LLM's LoRA keywords for a spec with ``num_loras`` (none without)."""
    n = spec.get("num_loras") or 0
    if not n:
        return {}
    return {"enable_lora": True, "max_loras": n, "max_lora_rank": spec["max_lora_rank"]}


def mixed_evenly(loras: list, num_requests: int) -> list:
    """Request i's adapter: the adapters in turn (None for all when there are none)."""
    return [loras[i % len(loras)] if loras else None for i in range(num_requests)]
