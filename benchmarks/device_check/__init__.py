"""One command that proves and times pagedjax on a GPU: run it first whenever a GPU is at hand.

Stages, each guarded (a failure is recorded with its traceback and the next stage still runs).
On one H200 stages 1-5 take about 8 minutes and stages 6-8 about 5 more; ``--stages 1,2,3``
runs a part. Each stage has its own time limit in seconds (``sizes.py``: env 15, kernels 90,
engine 60 + 150, decode 60, peer 75, serve 150, backends 90, probe 60): a stage checks it between
steps and stops early, and one that overruns is cut off at 1.5 times its limit plus 30 s;
``--budget-scale F`` multiplies every limit (a slower device: above 1).

  1 env       jax/jaxlib/torch/transformers versions, backend, device kind, memory, the Pallas
              GPU lowerings this JAX offers (Triton; Mosaic GPU) and the ops it ships
  2 kernels   decode and ragged paged attention on the device against the float32 reference:
              float32 and bfloat16, GQA 1/4/8, block sizes 16/32, NaN in every stale slot and in
              the null block, padding query rows NaN; through ``backend="gpu"`` and JAX's shipped
              ``jax.experimental.pallas.ops.gpu.paged_attention``; which lowering each ran (read
              from the lowered program) and every warning raised
  3 engine    (a) a tiny random Llama through ``LLM.generate``, greedy tokens equal to transformers
              on the same device, with a pool small enough to preempt (recompute, then swap) and
              a shared prompt prefix (prefix caching); (b) a Llama-3-8B-shaped random-weight
              model in bfloat16, built on the device (no download, no files; all 32 layers unless
              --big-layers says fewer) through ``LLM.generate`` on a ShareGPT-like workload:
              output tokens/s (warm), cold run, seconds per compiled program, KV blocks, peak
              device memory
  4 decode    benchmarks/paged_attention_gpu.py at reduced size: achieved bandwidth as a fraction
              of a device copy measured in the same run, ratio to JAX's shipped op
  5 peer      the stage-3b workload through transformers (PyTorch) on the same device, batch
              sweep, best batch size against pagedjax
  6 serve     online serving over HTTP: ``pagedjax bench serve`` against ``pagedjax serve`` and
              ``transformers serve --continuous-batching`` on the same GPU, one at a time, on a
              Llama-3.2-1B-shaped random-weight model (bfloat16, built on the device, a word-level
              tokenizer, no EOS: exact output lengths on both sides), random 256-token prompts,
              128-token outputs, concurrency 1/16/64: output tok/s, TTFT, TPOT per concurrency and
              the pagedjax / transformers ratios
  7 backends  every attention backend of the platform (``select_backend``) against a float64
              numpy oracle, decode and ragged, NaN in stale slots, GQA, block sizes, head dims,
              windows, soft caps, 8-bit KV; decode bandwidth per backend against a device copy
  8 probe     the decode step through the Runner: scan vs per-layer weights at 1 and 64
              sequences as a fraction of the memory floor, and dispatch vs device time per sampler
              variant (a step with no host wait returns before the device finishes)

Prints one summary table at the end (and each stage's lines as it goes); writes
``device_check.json`` (after every stage) and ``device_check.log`` under --out.

    python3 benchmarks/device_check --out device_check_out      # on a GPU (make device-check)
    python3 benchmarks/device_check --toy --out /tmp/dc          # CPU: toy sizes, interpret mode

No install is needed: the package puts the repository on sys.path (for a checkout that is not
installed, through a temporary tree of links that lays out ``pagedjax.models`` and
``pagedjax.pallas_kernels`` as an install does), so it runs on a machine's Python as it is (jax
with CUDA, torch, transformers, flax, orbax), without network. Stage 6 also needs the HTTP
packages, which a bare GPU image may lack (fastapi, starlette, pydantic, uvicorn; httpx2 for the
client; openai for transformers serve): ``make wheelhouse`` downloads their wheels (Python 3.12,
manylinux x86-64) into ``wheelhouse/`` (ignored by git), copied beside the checkout on a machine
without an index, and stage 6 installs them from there into a temporary directory
(``pip install --no-index --no-deps --target``). Without them stage 6 is skipped with the names
of what is missing; without a ``transformers`` executable (or its serving packages) it measures
pagedjax alone.

The package: ``bootstrap`` (import paths, run first), ``sizes`` (the device and toy sizes),
``common`` (the context, results and helpers stages share), ``running`` (one stage, guarded),
``stages/`` (one module per stage and the registry), ``cli`` (arguments, log, summary table).
Adding a stage: a module ``stages/NAME.py`` with ``run(ctx, budget, data) -> (ok, summary)``
(``data`` lands in the JSON; call ``budget.check(what)`` between steps, raise ``StageSkipped``
where it does not apply), one line in ``stages.STAGES`` (key -> number, title, run) and its
seconds in ``sizes.DEVICE.budgets`` and ``sizes.TOY.budgets``.
"""

import os

# JAX and torch share the GPU in one process: JAX takes half up front, torch (3a, 5) the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

from . import bootstrap  # noqa: E402, F401  (import paths before pagedjax)
from .cli import main, parse_args, run  # noqa: E402
from .stages import STAGES  # noqa: E402

__all__ = ["STAGES", "main", "parse_args", "run"]
