"""vLLM's POST /tokenize and /detokenize (serving_tokenization.py): a prompt's ids, or a
conversation's as /v1/chat/completions renders it, however long (the body's size bounds the
work); a list of ids' text."""

from __future__ import annotations

from pagedjax.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    bad_request,
    chat_messages,
    chat_options,
)
from pagedjax.entrypoints.openai.serving_engine import OpenAIServing
from pagedjax.entrypoints.openai.tools import check_tools, template_messages


class OpenAIServingTokenization(OpenAIServing):
    """/tokenize and /detokenize: the tokenizer and chat template alone, no engine request."""

    async def create_tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        return await self.offload.run(self._tokenize_body, req)

    async def create_detokenize(self, req: DetokenizeRequest) -> dict:
        return await self.offload.run(self._detokenize_body, req)

    # -- on the offload pool --

    def _tokenize_body(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        tok = self.offload.tokenizer
        if isinstance(req, TokenizeChatRequest):
            tools = check_tools(req.tools) or None
            messages = template_messages(chat_messages(req))
            options = chat_options(req)
            ids = self.render_chat(messages, tools, options, bounded=False)
        else:
            if tok is None:
                raise bad_request("this model has no tokenizer", "prompt")
            ids = self.tokenize(req.prompt, "prompt", req.add_special_tokens, bounded=False)
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        }

    def _detokenize_body(self, req: DetokenizeRequest) -> dict:
        """The text of ``req.tokens`` (special tokens kept, as vLLM)."""
        tok = self.offload.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer", "tokens")
        self.check_token_ids(req.tokens, "tokens")
        return {"prompt": tok.decode(req.tokens)}
