"""vLLM's engine options that pagedjax accepts for compatibility: those it lacks (refused when
set to what it cannot do, naming the option) and those that mean nothing here (accepted, and
logged when set). EngineArgs (engine/arg_utils.py) inherits them, so that they are flags and
LLM keywords like the rest."""

from __future__ import annotations

import dataclasses

from pagedjax.engine.arg_options import option, refuse_unless

EXECUTOR_BACKENDS = ("mp", "uni", "external_launcher", "ray")


@dataclasses.dataclass
class VllmCompatArgs:
    # ---- parallelism pagedjax does otherwise ---------------------------------------------------
    pipeline_parallel_size: int = option(
        1,
        "pipeline stages (only 1: pagedjax splits a model by tensor parallelism)",
        flags=("-pp",),
        check=refuse_unless(lambda n: n == 1, "pipeline parallelism is not supported"),
        group="parallel",
    )
    data_parallel_size: int = option(
        1,
        "engine replicas (only 1 here: `pagedjax serve --ray --num-replicas N` serves replicas)",
        flags=("-dp",),
        check=refuse_unless(
            lambda n: n == 1,
            "pagedjax runs one engine per process group; serve replicas with --ray "
            "--num-replicas N",
        ),
        group="parallel",
    )
    distributed_executor_backend: str | None = option(
        None,
        "how the engine's devices are driven: mp / uni (one process drives its host's devices, "
        "pagedjax's way), external_launcher (every host runs the same command: see "
        "--coordinator-address); ray is refused (Ray replicas: --ray)",
        choices=EXECUTOR_BACKENDS,
        check=refuse_unless(
            lambda b: b != "ray",
            "JAX drives the devices, not Ray workers; serve Ray replicas with --ray",
        ),
        group="parallel",
    )
    # ---- refused: what pagedjax lacks ---------------------------------------------------------
    limit_mm_per_prompt: dict | None = option(
        None,
        "multimodal items per prompt: only zeros (e.g. '{\"image\": 0}'), pagedjax serves "
        "text-only models",
        metavar="JSON",
        check=refuse_unless(
            lambda v: v is None or not any(v.values()),
            "multimodal inputs are not supported (only limits of 0)",
        ),
        group="refused",
    )
    # ---- inert: vLLM's options with no meaning here ------------------------------------------
    trust_remote_code: bool = option(
        False,
        "run the checkpoint's own Python code",
        inert="the families it runs are built in",
        group="inert",
    )
    enforce_eager: bool = option(
        False, "no CUDA graphs", inert="XLA compiles every step program", group="inert"
    )
    tokenizer_mode: str = option(
        "auto",
        "auto, slow, mistral or custom",
        choices=("auto", "slow", "mistral", "custom"),
        inert="the checkpoint's fast tokenizer (or the GGUF's) is used",
        group="inert",
    )
    max_seq_len_to_capture: int = option(
        8192, "CUDA graphs' longest sequence", inert="there are no CUDA graphs", group="inert"
    )
    disable_custom_all_reduce: bool = option(
        False, "NCCL's all-reduce only", inert="XLA's collectives are used", group="inert"
    )
    compilation_config: str | None = option(
        None,
        "torch.compile's level or config",
        flags=("-O",),
        inert="XLA compiles the step programs",
        group="inert",
    )
