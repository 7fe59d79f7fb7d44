"""pagedjax: vLLM's PagedAttention serving engine in JAX and Pallas."""

from pagedjax.engine import LLM, EngineStats
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineStats", "RequestOutput", "SamplingParams"]
