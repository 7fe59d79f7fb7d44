"""vLLM's prompt forms (``vllm.inputs``): wherever a prompt goes (``LLM.generate``,
``LLM.beam_search``, ``LLMEngine.add_request``) it may be

- a string, or a list of token ids;
- a ``TextPrompt``: ``{"prompt": "..."}``;
- a ``TokensPrompt``: ``{"prompt_token_ids": [...]}``, optionally with the ``prompt`` text the
  ids came from (then the output's ``prompt`` is that text).

vLLM's multimodal, embedding and encoder-decoder keys are refused by name: pagedjax serves
text-only decoder models.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

import numpy as np

__all__ = ["PromptType", "TextPrompt", "TokensPrompt", "is_one_prompt", "split_prompt"]


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, if the caller has it


PromptType = str | list[int] | TextPrompt | TokensPrompt

# vLLM's keys pagedjax lacks: what each would need
_UNSUPPORTED = {
    "multi_modal_data": "multimodal inputs",
    "mm_processor_kwargs": "multimodal inputs",
    "multi_modal_uuids": "multimodal inputs",
    "prompt_embeds": "prompts given as embeddings",
    "encoder_prompt": "encoder-decoder models",
    "decoder_prompt": "encoder-decoder models",
    "token_type_ids": "token type ids",
    "cache_salt": "salted prefix caching",
}


def split_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt, either may be None (a plain string has no ids yet; ids
    alone have no text). A malformed prompt raises ValueError naming what is wrong."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list | tuple | np.ndarray):
        return None, list(prompt)
    if not isinstance(prompt, dict):
        raise ValueError(
            "a prompt is a string, a list of token ids, {'prompt': text} or "
            f"{{'prompt_token_ids': ids}}, got {prompt!r:.80}"
        )
    for key, value in prompt.items():
        if key in _UNSUPPORTED and value not in (None, {}, []):
            raise ValueError(f"prompt key {key!r}: {_UNSUPPORTED[key]} are not supported")
        if key not in _UNSUPPORTED and key not in ("prompt", "prompt_token_ids"):
            raise ValueError(
                f"unknown prompt key {key!r}; a prompt dict has 'prompt' (text) and/or "
                "'prompt_token_ids'"
            )
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt must be a string, got {text!r:.80}")
    if ids is None:
        if text is None:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return text, None
    if not isinstance(ids, list | tuple | np.ndarray):
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {ids!r:.80}")
    return text, list(ids)


def is_one_prompt(prompts) -> bool:
    """Whether ``prompts`` is a single prompt rather than a sequence of them."""
    if isinstance(prompts, str | dict):
        return True
    return isinstance(prompts, list | tuple) and bool(prompts) and _is_token(prompts[0])


def _is_token(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)
