"""A conversation rendered by the tokenizer's chat template, as ``LLM.chat`` and the server's chat
endpoints (``/v1/chat/completions``, ``/tokenize``) do it, with vLLM's options: the generation
prompt, or the final message left open for the model to continue (``continue_final_message``:
prefill an assistant reply), and keyword arguments for the template itself
(``chat_template_kwargs``, e.g. ``{"enable_thinking": false}`` for Qwen3's).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from pagedjax.models.loading.tokenizer import encode_text


@functools.cache
def _reserved() -> frozenset[str]:
    """apply_chat_template's own arguments and the template's conversation: a template keyword
    argument of these names would be taken as (or clash with) them. (transformers is imported
    here, not with the module: the server's body-check process parses requests without it.)"""
    from transformers import PreTrainedTokenizerBase

    names = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(names) - {"self", "kwargs"} | {"messages"}


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered and tokenized; a bad combination is a ValueError whose
    message begins with the option's name."""

    add_generation_prompt: bool = True  # open the assistant's turn after the last message
    continue_final_message: bool = False  # leave the last message open (no end of turn)
    add_special_tokens: bool = False  # the tokenizer's BOS etc. on top of the template's
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    chat_template: str | None = None  # a jinja template in place of the tokenizer's

    def __post_init__(self):
        for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt; set "
                "add_generation_prompt to false to continue the final message"
            )
        kwargs = self.chat_template_kwargs
        if kwargs is None:
            return
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(
                f"chat_template_kwargs must be an object of named values, got {kwargs!r}"
            )
        clash = sorted(set(kwargs) & _reserved())
        if clash:
            raise ValueError(
                f"chat_template_kwargs: {clash[0]!r} is set by the request itself, not by a "
                "template keyword argument"
            )

    def render(self, tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The conversation as the template writes it (text, not yet tokenized)."""
        if self.continue_final_message and not messages:
            raise ValueError("continue_final_message: there is no final message to continue")
        kwargs = dict(self.chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            tokenize=False,
            **kwargs,
        )

    def tokenize(self, tokenizer, messages: list[dict], tools: list[dict] | None = None):
        """The rendered conversation's token ids."""
        text = self.render(tokenizer, messages, tools)
        return encode_text(tokenizer, text, self.add_special_tokens)
