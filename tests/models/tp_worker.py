"""Run in a subprocess with 4 virtual CPU devices (XLA_FLAGS set by the caller): generates with
tensor_parallel_size 1/2/4 (tiny Llama) and 1/3 (SmolLM2-135M), or with ``--families`` 1/2 (tiny
Gemma 2 and Qwen2-MoE), and prints a JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]  # the packages, then the helpers

from hf_models import make_tiny_model  # noqa: E402
from pagedjax.models.loader import default_model_path, load_model  # noqa: E402
from pagedjax.models.sharding import make_mesh  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.worker import programs  # noqa: E402
from pagedjax.worker.runner import ScheduledSeq  # noqa: E402
from pagedjax.worker.sampler import SamplingRow  # noqa: E402

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def device_bytes(arrays) -> tuple[int, int]:
    """(bytes on device 0, total logical bytes) over a list of arrays."""
    dev0 = jax.devices()[0]
    on0 = sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == dev0)
    return on0, sum(a.nbytes for a in arrays)


def step_hlo(llm: LLM) -> str:
    r = llm.runner
    seqs = [ScheduledSeq([5, 6, 7], 0, [1], [SamplingRow()])]
    step_input = r.build_step_input(seqs)
    lowered = programs.forward.lower(r.params, r.kv_cache.pages, r.place(step_input), r.statics)
    return lowered.compile().as_text()


def run(path: str, prompts, degrees, block_size: int) -> dict:
    report = {}
    for tp in degrees:
        try:
            llm = LLM(
                path,
                block_size=block_size,
                num_blocks=64,
                max_model_len=256,
                tensor_parallel_size=tp,
            )
        except ValueError as e:
            report[tp] = {"error": str(e)}
            continue
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        pool = list(llm.runner.kv_cache.pages)  # K and V, every layer
        params = jax.tree_util.tree_flatten_with_path(llm.runner.params)[0]
        entry = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "kv_bytes": device_bytes(pool),
            "param_bytes": device_bytes([p for _, p in params]),
            "params": {  # name -> (bytes on device 0, total bytes)
                "/".join(k.key for k in path): device_bytes([p]) for path, p in params
            },
        }
        if tp > 1:
            hlo = step_hlo(llm)
            pool_shape = "[{},{},{},{}]".format(*pool[0].shape)
            entry["all_gathers_of_pool"] = [
                line.strip()
                for line in hlo.splitlines()
                if "all-gather" in line and pool_shape in line
            ]
            entry["num_all_reduces"] = hlo.count("all-reduce(")
            tree = llm.runner.params
            tables = [tree["embed_tokens"]["embedding"]]
            tables += [tree["lm_head"]["kernel"]] if "lm_head" in tree else []
            shapes = ["[{},{}]".format(*t.shape) for t in tables]
            entry["embedding_tables_split"] = [not t.sharding.is_fully_replicated for t in tables]
            entry["all_gathers_of_embedding"] = [
                line.strip()
                for line in hlo.splitlines()
                if "all-gather" in line and any(shape in line for shape in shapes)
            ]
        report[tp] = entry
        llm.close()
    return report


def families(tmp: Path) -> dict:
    """Gemma 2 (alternating windows, soft caps) and Qwen2-MoE (experts split by their
    intermediate dimension, a shared expert, a dense layer), prompts past the window."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 20, 30)]
    report = {}
    for name in ("gemma2", "qwen2_moe"):
        make_tiny_model(name, tmp / name)
        report[name] = run(str(tmp / name), prompts, (1, 2), block_size=8)
    return report


def main() -> None:
    tmp = Path(sys.argv[1])
    if "--families" in sys.argv:
        print("REPORT " + json.dumps(families(tmp)))
        return
    make_tiny_model("llama_gqa", tmp / "tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 16, 30)]
    report = {"tiny": run(str(tmp / "tiny"), prompts, (1, 2, 4), block_size=8)}
    # The converted params are cached now: a load onto a mesh restores each device's slices.
    q = load_model(str(tmp / "tiny"), mesh=make_mesh(2)).params["layers"]["self_attn"]
    q = q["q_proj"]["kernel"]
    report["sharded_restore"] = {
        "shape": q.shape,
        "shards": [list(s.data.shape) for s in q.addressable_shards],
    }
    # A cache written from a 4-way split, restored without a mesh, lands on one device.
    load_model(str(tmp / "tiny"), cache_dir=tmp / "cache4", mesh=make_mesh(4))
    unsplit = load_model(str(tmp / "tiny"), cache_dir=tmp / "cache4").params
    report["restore_without_mesh_devices"] = sorted(
        {d.id for leaf in jax.tree.leaves(unsplit) for d in leaf.sharding.device_set}
    )
    if "--smollm" in sys.argv:
        smol = ["The capital of France is", "def fibonacci(n):"]
        report["smollm"] = run(default_model_path(), smol, (1, 2, 3), block_size=16)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
