"""POST /v1/chat/completions (vLLM's serving_chat.py), and /v1/responses, which runs as one
(routes_responses.py): the request's tools and tool choice (tools.py), the conversation
rendered by the chat template and tokenized, its params and checks, then one GenerationJob with
a ChatShape, run by the shared base."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from pagedjax.entrypoints.openai.job import GenerationJob
from pagedjax.entrypoints.openai.protocol import (
    ChatRequest,
    ServerLimits,
    bad_request,
    chat_echo,
    chat_messages,
    chat_options,
)
from pagedjax.entrypoints.openai.request_params import (
    check_response_logprobs,
    default_max_tokens,
    engine_params,
)
from pagedjax.entrypoints.openai.response_shapes import ChatShape
from pagedjax.entrypoints.openai.serving_engine import OpenAIServing
from pagedjax.entrypoints.openai.tools import ToolConfig, template_messages, tool_mode


class OpenAIServingChat(OpenAIServing):
    """``tool_config``: the server's --enable-auto-tool-choice and --tool-call-parser."""

    def __init__(
        self,
        client,
        tokenizer,
        model_name: str,
        offload,
        limits: ServerLimits,
        *,
        tool_config: ToolConfig,
    ):
        super().__init__(client, tokenizer, model_name, offload, limits)
        self.tool_config = tool_config

    async def create_chat_completion(
        self, request: Request, req: ChatRequest, constraint, constraint_field: str, lora
    ) -> Response:
        """Answer ``req``, whose own structured-output ``constraint`` (response_format,
        structured_outputs or a guided field) came from ``constraint_field``, under the LoRA
        adapter ``lora`` its model named (or None)."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise bad_request("this model's tokenizer has no chat template")
        args = (req, constraint, constraint_field)
        if req.tools:  # walks the tools' schemas: off the event loop
            got = await self.offload.run_grammar(self._tools, *args)
        else:
            got = self._tools(*args)
        constraint, constraint_field, shown_tools, tools = got
        options = chat_options(req)
        messages = template_messages(chat_messages(req))
        truncate = req.truncate_prompt_tokens
        ids = await self.offload.run(self.render_chat, messages, shown_tools, options, truncate)
        max_tokens, field = req.requested_max_tokens()
        if max_tokens is None:
            max_tokens = default_max_tokens(self.max_model_len - len(ids), self.defaults)
        k = req.logprobs_k()
        await self.check_constraint(constraint, constraint_field)
        params = engine_params(
            req, max_tokens, field, constraint, constraint_field, self.params_context
        )
        check_response_logprobs(
            self.limits,
            [ids],
            k=k,
            n=req.n,
            max_tokens=max_tokens,
            echo=False,
            field=req.logprobs_field,
        )
        self.check_prompt_logprobs([ids], req.prompt_logprobs)
        self.check_priority(req.priority)
        await self.admit([ids], params, "messages")
        shape = ChatShape(k=k, prompt_k=req.prompt_logprobs, tools=tools, echo=chat_echo(req))
        return await self.run(request, GenerationJob.of(req, [ids], params, shape, lora))

    def _tools(self, req: ChatRequest, constraint, field: str):
        """(constraint, its field, the tools shown to the template, the tool mode) of ``req``
        whose own structured output is ``constraint`` (from ``field``): it, or the schema its
        tool choice imposes."""
        shown_tools, tools = tool_mode(req, self.tool_config, constraint)
        if tools is not None and tools.constraint is not None:  # "required" or named
            constraint, field = tools.constraint, "tools"
        return constraint, field, shown_tools, tools
