"""pagedjax: vLLM's PagedAttention serving engine in JAX and Pallas."""

from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.entrypoints.llm import LLM
from pagedjax.lora.request import LoRARequest
from pagedjax.outputs import CompletionOutput, EngineStats, RequestOutput
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineStats",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
