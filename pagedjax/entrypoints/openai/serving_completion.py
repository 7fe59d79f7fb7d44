"""POST /v1/completions (vLLM's serving_completion.py): a request's prompts as token ids (texts
tokenized, or ids checked against the vocabulary), its params and checks, then one
GenerationJob with a CompletionShape, run by the shared base."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from pagedjax.engine.input_processor import truncated
from pagedjax.entrypoints.openai.job import GenerationJob
from pagedjax.entrypoints.openai.protocol import CompletionRequest, bad_request
from pagedjax.entrypoints.openai.request_params import (
    check_response_logprobs,
    default_max_tokens,
    engine_params,
)
from pagedjax.entrypoints.openai.response_shapes import CompletionShape, Echo
from pagedjax.entrypoints.openai.serving_engine import OpenAIServing


def split_prompt(p) -> tuple[list[str] | None, list[list[int]] | None]:
    """A completion request's ``prompt`` as (texts, None) or (None, token id lists)."""
    if isinstance(p, str):
        return [p], None
    if p and all(isinstance(x, str) for x in p):
        return p, None
    if p and all(isinstance(x, list) for x in p):
        return None, [list(x) for x in p]
    return None, [list(p)]


class OpenAIServingCompletion(OpenAIServing):
    """/v1/completions: one engine request per prompt, text choices (CompletionShape)."""

    async def create_completion(
        self, request: Request, req: CompletionRequest, constraint, constraint_field: str, lora
    ) -> Response:
        """Answer ``req``, whose structured-output ``constraint`` came from
        ``constraint_field``, under the LoRA adapter ``lora`` its model named (or None)."""
        texts, prompts = split_prompt(req.prompt)
        count = len(texts or prompts)
        if count > self.limits.max_queue:
            raise bad_request(
                f"prompt: {count} prompts in one request; this server queues at most "
                f"{self.limits.max_queue}",
                "prompt",
            )
        prompts = await self.offload.run(self._prompt_ids, texts, prompts, req)
        max_tokens = req.max_tokens
        if max_tokens is None:
            room = self.max_model_len - max(len(x) for x in prompts)
            max_tokens = default_max_tokens(room, self.defaults)
        echo_only = req.echo and max_tokens == 0  # the engine makes one token, never shown
        await self.check_constraint(constraint, constraint_field)
        run_tokens = 1 if echo_only else max_tokens
        args = (constraint, constraint_field, self.params_context)
        params = engine_params(req, run_tokens, "max_tokens", *args)
        shown = 0 if echo_only else max_tokens
        check_response_logprobs(
            self.limits,
            prompts,
            k=req.logprobs,
            n=req.n,
            max_tokens=shown,
            echo=req.echo,
            field="logprobs",
        )
        self.check_prompt_logprobs(prompts * req.n, req.prompt_logprobs)  # on every choice
        self.check_priority(req.priority)
        await self.admit(prompts, params, "prompt")
        echo = None
        if req.echo:
            if texts is None or req.truncate_prompt_tokens is not None:  # the prompt that runs
                texts = await self.offload.run(self._decoded, prompts)
            echo = Echo(tuple(texts), echo_only)
        shape = CompletionShape(k=req.logprobs, prompt_k=req.prompt_logprobs, echo=echo)
        return await self.run(request, GenerationJob.of(req, prompts, params, shape, lora))

    # -- on the offload pool --

    def _prompt_ids(self, texts, prompts, req: CompletionRequest) -> list[list[int]]:
        """The prompts as token ids (``texts`` tokenized, else ``prompts``; their last
        truncate_prompt_tokens), every id checked against the vocabulary."""
        truncate = req.truncate_prompt_tokens
        if texts is not None:
            bounded = truncate is None
            prompts = [self.tokenize(t, "prompt", bounded=bounded) for t in texts]
        ids = [truncated(x, truncate, self.max_model_len) for x in prompts]
        for x in ids:
            self.check_token_ids(x)
        return ids

    def _decoded(self, prompts: list[list[int]]) -> list[str]:
        """The prompts' texts as they run (echo's)."""
        tok = self.offload.tokenizer
        return ["" if tok is None else tok.decode(ids, skip_special_tokens=True) for ids in prompts]
