"""pagedjax: vLLM's PagedAttention serving engine in JAX and Pallas."""


def _check_not_shadowed() -> None:
    """The repository's models/ and pallas_kernels/ install as pagedjax.models and
    pagedjax.pallas_kernels. Python started in a clone's root finds the clone's pagedjax/ folder
    first, which has neither: say so, rather than fail later on a missing module."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("pagedjax.models") is not None:
        return
    here = Path(__file__).resolve().parent
    raise ImportError(
        f"pagedjax was imported from {here}, a source checkout's folder, which shadows the "
        "installed package: the checkout's models/ and pallas_kernels/ become pagedjax.models "
        "and pagedjax.pallas_kernels only when installed. Install the checkout editable "
        f"(pip install -e {here.parent}), or run Python from another folder."
    )


_check_not_shadowed()

from pagedjax.engine.arg_utils import EngineArgs  # noqa: E402
from pagedjax.engine.llm_engine import LLMEngine  # noqa: E402
from pagedjax.entrypoints.llm import LLM  # noqa: E402
from pagedjax.inputs import PromptType, TextPrompt, TokensPrompt  # noqa: E402
from pagedjax.lora.request import LoRARequest  # noqa: E402
from pagedjax.outputs import (  # noqa: E402
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    EngineStats,
    Logprob,
    RequestOutput,
)
from pagedjax.sampling_params import (  # noqa: E402
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "EngineStats",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
