"""pagedjax: vLLM's PagedAttention serving engine in JAX and Pallas."""

from pagedjax.engine import LLMEngine
from pagedjax.llm import LLM
from pagedjax.outputs import CompletionOutput, EngineStats, RequestOutput
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
