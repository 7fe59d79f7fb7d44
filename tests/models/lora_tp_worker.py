"""Run in a subprocess with 4 virtual CPU devices (XLA_FLAGS set by the caller): a tiny model's
forward with LoRA adapters in mixed slots under tensor_parallel_size 1, 2 and 4 (4 > its 2 KV
heads: they are replicated, and the k/v adapters' B with them). Prints a JSON report: each
degree's logits, the slots' partition specs, and what device 0 holds of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from pagedjax.models.llama import forward  # noqa: E402
from pagedjax.models.loader import load_model  # noqa: E402
from pagedjax.models.lora import LoRABatch, init_slots, load_adapter, set_slot  # noqa: E402
from pagedjax.models.sharding import make_mesh, replicate_kv_heads, sharded_config  # noqa: E402

from pagedjax.worker.runner import Runner, RunnerConfig, ScheduledSeq  # noqa: E402

_forward = jax.jit(forward, static_argnums=(3, 4, 5, 6))


def run(base: str, adapter_dirs: list[str], prompts, slots_per_prompt, tp: int) -> dict:
    loaded = load_model(base, use_cache=False)
    mesh = make_mesh(tp) if tp > 1 else None
    config = sharded_config(loaded.config, tp)
    params = replicate_kv_heads(loaded.params, loaded.config, tp)
    runner = Runner(
        config, params, RunnerConfig(num_blocks=64, block_size=8, max_model_len=64), mesh=mesh
    )
    slots = init_slots(config, len(adapter_dirs), 16, runner.dtype, mesh)
    specs_before = jax.tree.map(lambda x: str(x.sharding), slots)
    for i, d in enumerate(adapter_dirs, start=1):
        slots = set_slot(slots, i, load_adapter(d, loaded.config, 16))
    tables = [[1 + 4 * i, 2 + 4 * i, 3 + 4 * i] for i in range(len(prompts))]
    seqs = [ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    step = runner.build_step_input(seqs)
    rows = np.arange(sum(len(p) for p in prompts), dtype=np.int32)
    step = step.replace(logits_indices=rows)
    token_slot = np.zeros(step.token_ids.shape, np.int32)
    token_slot[: len(rows)] = np.repeat(slots_per_prompt, [len(p) for p in prompts])
    placed = NamedSharding(mesh, P()) if mesh is not None else jax.devices()[0]
    step, token_slot = jax.device_put((step, jnp.asarray(token_slot)), placed)
    batch = LoRABatch(slots, token_slot)
    logits, _ = _forward(
        runner.params,
        runner.kv_cache.pages,
        step,
        config,
        runner.backend,
        mesh,
        runner.linear,
        batch,
    )
    dev0 = jax.devices()[0]
    held = {
        f"{kind}/{name}": [s.data.shape for s in x.addressable_shards if s.device == dev0][0]
        for kind, tree in (("a", slots.a), ("b", slots.b))
        for name, x in tree.items()
    }
    return {
        "logits": np.asarray(logits).tolist(),
        "specs": {
            f"{kind}/{name}": str(x.sharding.spec) if mesh is not None else "one device"
            for kind, tree in (("a", slots.a), ("b", slots.b))
            for name, x in tree.items()
        },
        "kept_shardings": specs_before == jax.tree.map(lambda x: str(x.sharding), slots),
        "device0_shapes": held,
    }


def main() -> None:
    base, adapters = sys.argv[1], sys.argv[2].split(",")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 9, 3, 7)]
    slots_per_prompt = [1, 0, 3, 2]
    report = {"prompts": prompts, "slots": slots_per_prompt}
    for tp in (1, 2, 4):
        report[str(tp)] = run(base, adapters, prompts, slots_per_prompt, tp)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
