"""What every stage shares: its context and result, the budget it checks, printing, and the
helpers more than one stage uses."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from .sizes import LLAMA3_8B, Sizes

TOLERANCE = {"float32": 1e-4, "bfloat16": 1.5e-2}  # max |out - ref| / max |ref|


TOY_NOTE = " (toy run: timings meaningless)"


class StageTimeout(BaseException):
    """Raised in the main thread when a stage overruns its hard limit (BaseException, so that
    no ``except Exception`` inside the stage swallows it)."""


class BudgetSpent(Exception):
    """A stage's soft budget is spent: it stops early and reports what it has (PARTIAL)."""


class StageSkipped(Exception):
    """The stage does not apply here (e.g. a GPU-only comparison on a TPU)."""


@dataclasses.dataclass
class Budget:
    seconds: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise BudgetSpent(f"budget of {self.seconds:.0f} s spent before {what}")


@dataclasses.dataclass
class StageResult:
    key: str
    title: str
    status: str = "SKIP"  # PASS | FAIL (a check failed) | ERROR | PARTIAL (budget) | SKIP
    seconds: float = 0.0
    summary: str = ""
    data: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    warnings: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Context:
    sizes: Sizes
    platform: str  # jax.default_backend(): "gpu", "tpu" or "cpu"
    interpret: bool  # run the Pallas kernels interpreted (toy run)
    out: Path
    command: str = ""
    results: dict = dataclasses.field(default_factory=dict)  # key -> StageResult

    @property
    def kernel_backend(self) -> str:
        return "tpu" if self.platform == "tpu" else "gpu"

    @property
    def torch_device(self) -> str:
        import torch

        return "cuda" if self.platform == "gpu" and torch.cuda.is_available() else "cpu"


def say(*parts) -> None:
    print(*parts, flush=True)


def write_json(ctx: Context) -> None:
    payload = {
        "command": ctx.command,
        "sizes": dataclasses.asdict(ctx.sizes),
        "interpret": ctx.interpret,
        "stages": {k: dataclasses.asdict(r) for k, r in ctx.results.items()},
    }
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "device_check.json").write_text(json.dumps(payload, indent=2, default=str))


def big_hf_config(ctx: Context):
    import transformers

    hf = dict(ctx.sizes.big_config, num_hidden_layers=ctx.sizes.big_layers)
    return transformers.LlamaConfig(**hf)


def big_workload(ctx: Context, vocab_size: int, seed: int):
    from pagedjax.bench.throughput_sides import synthetic_requests

    s = ctx.sizes
    return synthetic_requests(
        s.num_requests,
        vocab_size=vocab_size,
        max_prompt_len=s.max_prompt_len,
        max_output_len=s.max_output_len,
        seed=seed,
    )


def shape_name(ctx: Context) -> str:
    return "Llama-3-8B-shaped" if ctx.sizes.big_config is LLAMA3_8B else "toy Llama"


def fmt_e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def fmt_f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def ratio(a, b):
    return None if a is None or not b else a / b
