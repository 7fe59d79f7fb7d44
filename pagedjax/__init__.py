"""pagedjax: vLLM's PagedAttention serving engine in JAX and Pallas."""

from pagedjax.engine import LLM, EngineStats, LLMEngine
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
