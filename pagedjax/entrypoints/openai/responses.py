"""What the endpoints answer with, built from the engine's outputs: a finished request's JSON
body, or a stream's server-sent events. Plain functions of their inputs; the server runs the large
ones (logprobs, echoed prompts) on its offload pool, off the event loop.
"""

from __future__ import annotations

import dataclasses
import json

from pagedjax.entrypoints.openai.logprobs import (
    TextOffsets,
    TokenIds,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    join_logprobs,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
)
from pagedjax.entrypoints.openai.offload import dumps, dumps_bytes
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams


@dataclasses.dataclass
class Echo:
    """Completions' echo: each prompt's text comes back before its completion."""

    texts: list[str]  # one per prompt
    only: bool  # max_tokens=0: the prompt alone (the engine's one token is not shown)


def usage(prompts, num_generated: int) -> dict:
    num_prompt = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_generated,
        "total_tokens": num_prompt + num_generated,
    }


def clamp(offsets: list[int], text: str) -> list[int]:
    return [min(o, len(text)) for o in offsets]


class Responses:
    """Response bodies for one model: its tokenizer (decoding only), EOS ids and served name."""

    def __init__(self, tokenizer, eos_token_ids, model_name: str, strings=None):
        self.tokenizer = tokenizer
        self.strings = strings or TokenStrings(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.model_name = model_name
        self._as_ids: Responses | None = None

    def with_token_ids(self) -> Responses:
        """The same responses with each logprob's token as ``token_id:N`` (vLLM's
        return_tokens_as_token_ids)."""
        if self._as_ids is None:
            args = (self.tokenizer, self.eos_token_ids, self.model_name)
            self._as_ids = Responses(*args, strings=TokenIds(self.tokenizer))
        return self._as_ids

    def completion_logprobs(self, echo, i, prompt_ids, out, c, k, shown_text):
        """A completion choice's logprobs: the echoed prompt's, then its generated tokens'."""
        gen = None
        if c is not None and c.logprobs is not None:
            offsets = TextOffsets(self.tokenizer, prompt_ids).feed(c.token_ids)
            gen = completion_logprobs(
                self.strings, c.token_ids, c.logprobs, k, clamp(offsets, shown_text)
            )
        if echo is None:
            return gen
        if out.prompt_logprobs is None:  # no logprobs asked: the prompt's text alone
            return gen
        head = prompt_completion_logprobs(self.strings, prompt_ids, out.prompt_logprobs, k)
        head["text_offset"] = clamp(head["text_offset"], echo.texts[i])
        return join_logprobs(head, gen, len(echo.texts[i]))

    def final_body(
        self,
        rid: str,
        now: int,
        chat: bool,
        n: int,
        params: SamplingParams,
        prompts: list[list[int]],
        finals: list[RequestOutput],
        k_logprobs: int | None,
        echo: Echo | None,
        model: str | None = None,
        prompt_k: int | None = None,
    ) -> bytes:
        """The whole response to a request that is not streamed (``finals``: one finished
        output per prompt), encoded; ``model``: the name it ran under (a LoRA adapter's), else
        the served model's; ``prompt_k``: vLLM's prompt_logprobs field, with k alternatives
        (on each completion choice; once for a chat response)."""
        choices, generated = [], 0
        for i, final in enumerate(finals):
            outs = final.outputs
            if echo is None or not echo.only:
                generated += sum(len(c.token_ids) for c in outs)
            if len(outs) > n:  # best_of: the n of highest cumulative logprob, best first
                outs = sorted(outs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
            for rank, c in enumerate(outs):
                ranked = getattr(params, "n", n) > n  # best_of (beams come ranked)
                index = i * n + (rank if ranked else c.index)
                lp, finish = None, c.finish_reason
                reason = c.stop_reason
                if chat:
                    if k_logprobs is not None and c.logprobs is not None:
                        lp = chat_logprobs(self.strings, c.token_ids, c.logprobs, k_logprobs)
                    choice = {"index": index, "logprobs": lp, "finish_reason": finish}
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    shown = None if echo is not None and echo.only else c
                    if shown is None:
                        finish, reason = "length", None
                    text = (echo.texts[i] if echo else "") + (shown.text if shown else "")
                    if k_logprobs is not None:
                        lp = self.completion_logprobs(
                            echo, i, prompts[i], final, shown, k_logprobs, c.text
                        )
                    choice = {"index": index, "logprobs": lp, "finish_reason": finish}
                    choice["text"] = text
                choice["stop_reason"] = reason
                if prompt_k is not None and not chat:
                    choice["prompt_logprobs"] = self.prompt_logprobs(final, prompt_k)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now,
            "model": model or self.model_name,
            "choices": choices,
            "usage": usage(prompts, generated),
        }
        if prompt_k is not None and chat:
            body["prompt_logprobs"] = self.prompt_logprobs(finals[0], prompt_k)
        return dumps_bytes(body)

    def prompt_logprobs(self, final: RequestOutput, k: int) -> list | None:
        if final.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.strings, final.prompt_logprobs, k)


def with_chat_echo(body: bytes, text: str) -> bytes:
    """A chat response whose every message begins with ``text`` (vLLM's chat echo)."""
    data = json.loads(body)
    for choice in data["choices"]:
        choice["message"]["content"] = text + (choice["message"]["content"] or "")
    return dumps_bytes(data)


class StreamEvents:
    """One streamed request's state: what each choice has been sent so far. ``events(out)``
    turns the engine's next output into the events to send."""

    def __init__(
        self,
        responses: Responses,
        rid,
        now,
        request_ids,
        prompts,
        params,
        chat,
        k,
        echo,
        model=None,
        continuous_usage=False,
        chat_echo="",
    ):
        self.r = responses
        # vLLM's continuous_usage_stats: each chunk carries its choice's usage so far
        self.continuous_usage = continuous_usage
        self.chat_echo = chat_echo  # vLLM's chat echo: sent after each choice's role
        self.model = model or responses.model_name  # a LoRA adapter's name when one ran
        self.rid, self.now, self.chat = rid, now, chat
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.index_of = {r: i for i, r in enumerate(request_ids)}
        self.prompts, self.params, self.k, self.echo = prompts, params, k, echo
        self.n = params.n
        # a stop string may be forming in the last characters: they wait for the next token
        self.hold = params.stop_hold
        self.echoed: set[int] = set()  # choices whose echoed prompt is sent
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()
        self.offsets: dict[int, TextOffsets] = {}
        self.generated = 0  # tokens streamed so far, for the usage chunk

    def is_heavy(self, out: RequestOutput) -> bool:
        """Whether building ``out``'s events is worth a trip to the offload pool: logprobs, an
        echoed prompt, or a finish (whose stop_reason may replay the detokenization)."""
        return self.k is not None or self.echo is not None or out.finished

    def event(self, body: dict) -> str:
        return f"data: {dumps(body)}\n\n"

    def chunk(self, index, text, finish, lp, first=False, stop_reason=None) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        choice["stop_reason"] = stop_reason
        body = {
            "id": self.rid,
            "object": self.kind,
            "created": self.now,
            "model": self.model,
            "choices": [choice],
        }
        if self.continuous_usage:
            prompt = self.prompts[index // self.n]
            body["usage"] = usage([prompt], self.sent_tokens.get(index, 0))
        return f"data: {dumps(body)}\n\n"

    def opening(self) -> list[str]:
        """Chat streams open with each choice's role (and the echoed assistant message)."""
        if not self.chat:
            return []
        count = len(self.prompts) * self.n
        events = [self.chunk(i, "", None, None, first=True) for i in range(count)]
        if self.chat_echo:
            events += [self.chunk(i, self.chat_echo, None, None) for i in range(count)]
        return events

    def usage_event(self) -> str:
        body = {
            "id": self.rid,
            "object": self.kind,
            "created": self.now,
            "model": self.model,
            "choices": [],
            "usage": usage(self.prompts, self.generated),
        }
        return self.event(body)

    def events(self, out: RequestOutput) -> list[str]:
        p = self.index_of[out.request_id]
        events = []
        for c in out.outputs:
            index = p * self.n + c.index
            if index not in self.done:
                events.extend(self._choice_events(out, p, index, c))
        return events

    def _echo_head(self, out, p, index, finish):
        """The echoed prompt (and its logprobs) if not sent yet: (text, logprobs), or None while
        the prompt's logprobs are still being scored."""
        if self.echo is None or index in self.echoed:
            return "", None
        if self.k is not None and out.prompt_logprobs is None and not finish:
            return None  # the prompt's logprobs come once it is all scored
        self.echoed.add(index)
        head, head_lp = self.echo.texts[p], None
        if self.k is not None and out.prompt_logprobs is not None:
            head_lp = prompt_completion_logprobs(
                self.r.strings, self.prompts[p], out.prompt_logprobs, self.k
            )
            head_lp["text_offset"] = clamp(head_lp["text_offset"], head)
        return head, head_lp

    def _choice_events(self, out, p, index, c) -> list[str]:
        finish = c.finish_reason
        got = self._echo_head(out, p, index, finish)
        if got is None:
            return []
        head, head_lp = got
        if self.echo is not None and self.echo.only:  # the prompt alone
            if finish:
                self.done.add(index)
            if head or head_lp or finish:
                return [self.chunk(index, head, "length" if finish else None, head_lp)]
            return []
        start_t, start_k = self.sent_text.get(index, 0), self.sent_tokens.get(index, 0)
        end_t = len(c.text) if finish else max(len(c.text) - self.hold, start_t)
        new_ids = c.token_ids[start_k:]
        lp = None
        if self.k is not None and c.logprobs is not None and new_ids:
            new_lps = c.logprobs[start_k:]
            if self.chat:
                lp = chat_logprobs(self.r.strings, new_ids, new_lps, self.k)
            else:
                tracker = self.offsets.setdefault(
                    index, TextOffsets(self.r.tokenizer, self.prompts[p])
                )
                offs = clamp(tracker.feed(new_ids), c.text)
                lp = completion_logprobs(self.r.strings, new_ids, new_lps, self.k, offs)
        text = c.text[start_t:end_t]
        if self.echo is not None:
            if lp is not None:
                shift = len(self.echo.texts[p])
                lp["text_offset"] = [o + shift for o in lp["text_offset"]]
            lp = join_logprobs(head_lp, lp, 0) if head_lp is not None else lp
            text = head + text
        self.sent_text[index], self.sent_tokens[index] = end_t, len(c.token_ids)
        self.generated += len(new_ids)
        reason = None
        if finish:
            self.done.add(index)
            reason = c.stop_reason
        if text or lp or finish:
            return [self.chunk(index, text, finish, lp, stop_reason=reason)]
        return []
