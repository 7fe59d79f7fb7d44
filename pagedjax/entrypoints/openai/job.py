"""One generation request as the server runs it (vLLM keeps request-to-params on the request):
an endpoint turns its validated body into one frozen ``GenerationJob`` — the prompts as token
ids, the engine's params, the LoRA adapter, the priority, how it streams and the response shape
(response_shapes.py) — and the shared base (serving_engine.py) runs it."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from pagedjax.entrypoints.openai.protocol import GenerationRequest
from pagedjax.lora.request import LoRARequest
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedjax.entrypoints.openai.response_shapes import ResponseShape


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """How a streamed answer reports usage (OpenAI's stream_options)."""

    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: each chunk its choice's


@dataclasses.dataclass(frozen=True)
class GenerationJob:
    """Everything the base needs to run one request and answer it."""

    prompts: tuple[list[int], ...]  # one engine request per prompt, each its token ids
    params: SamplingParams | BeamSearchParams  # FINAL_ONLY outputs when not streamed
    shape: ResponseShape  # the endpoint's choices, chunks and body
    n: int  # choices shown per prompt (params may generate more: best_of)
    lora: LoRARequest | None = None  # the adapter its ``model`` named; None: the base model
    priority: int = 0
    stream: StreamSettings | None = None  # None: one whole answer
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens as ids
    response_id: str = ""  # the answer's "id"
    created: int = 0  # the answer's "created" (seconds since the epoch)

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("a job needs at least one prompt")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

    @classmethod
    def of(
        cls, req: GenerationRequest, prompts: list[list[int]], params, shape: ResponseShape, lora
    ) -> GenerationJob:
        """The job of ``req`` (its n, priority, stream and stream_options, token ids option)
        with its ``prompts``' ids, its engine ``params``, its ``shape`` and its ``lora``. A
        whole answer reads only the finished outputs, so its requests ask for nothing else
        (vLLM's FINAL_ONLY): no output is built, sent or awaited at the steps in between."""
        stream = None
        if req.stream:
            options = req.stream_options
            include = options is not None and options.include_usage
            stream = StreamSettings(include, include and options.continuous_usage_stats)
        else:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        return cls(
            prompts=tuple(prompts),
            params=params,
            shape=shape,
            n=req.n,
            lora=lora,
            priority=req.priority,
            stream=stream,
            token_ids=req.return_tokens_as_token_ids,
            response_id=shape.new_id(),
            created=int(time.time()),
        )

    @property
    def model_name(self) -> str | None:
        """The name the answer runs under: its LoRA adapter's, else None (the served model's)."""
        return self.lora.lora_name if self.lora is not None else None
