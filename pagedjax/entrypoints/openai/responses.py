"""What the endpoints answer with, built from the engine's outputs: a finished request's JSON
body, or a stream's server-sent events. Both take the request's GenerationJob (job.py); what
differs between endpoints is its shape's (response_shapes.py). Plain functions of their inputs;
the server runs the large ones (logprobs, echoed prompts) on its offload pool, off the event
loop.
"""

from __future__ import annotations

from pagedjax.entrypoints.openai.job import GenerationJob
from pagedjax.entrypoints.openai.logprobs import TokenIds, TokenStrings, vllm_prompt_logprobs
from pagedjax.entrypoints.openai.offload import dumps, dumps_bytes
from pagedjax.outputs import RequestOutput


def usage(prompts, num_generated: int) -> dict:
    num_prompt = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_generated,
        "total_tokens": num_prompt + num_generated,
    }


class Responses:
    """Response bodies for one model: its tokenizer (decoding only), EOS ids and served name."""

    def __init__(self, tokenizer, eos_token_ids, model_name: str, strings=None):
        self.tokenizer = tokenizer
        self.strings = strings or TokenStrings(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.model_name = model_name
        self._as_ids: Responses | None = None

    def for_job(self, job: GenerationJob) -> Responses:
        """These responses, or with each logprob's token as ``token_id:N`` where the job asks
        (vLLM's return_tokens_as_token_ids)."""
        if not job.token_ids:
            return self
        if self._as_ids is None:
            args = (self.tokenizer, self.eos_token_ids, self.model_name)
            self._as_ids = Responses(*args, strings=TokenIds(self.tokenizer))
        return self._as_ids

    def final_body(self, job: GenerationJob, finals: list[RequestOutput]) -> bytes:
        """The whole response to a job that is not streamed (``finals``: one finished output
        per prompt), encoded, before the shape's ``finish_body``; it names the job's LoRA
        adapter as its model where one ran, else the served model."""
        shape, n = job.shape, job.n
        ranked = getattr(job.params, "n", n) > n  # best_of (beams come ranked)
        choices, generated = [], 0
        for i, final in enumerate(finals):
            outs = final.outputs
            generated += shape.generated_tokens(outs)
            if len(outs) > n:  # best_of: the n of highest cumulative logprob, best first
                outs = sorted(outs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
            for rank, c in enumerate(outs):
                index = i * n + (rank if ranked else c.index)
                choices.append(shape.final_choice(self, job, i, final, c, index))
        choices.sort(key=lambda ch: ch["index"])
        body = {
            "id": job.response_id,
            "object": shape.object_kind,
            "created": job.created,
            "model": job.model_name or self.model_name,
            "choices": choices,
            "usage": usage(job.prompts, generated),
        }
        shape.add_body_fields(self, body, finals)
        return dumps_bytes(body)

    def prompt_logprobs(self, final: RequestOutput, k: int) -> list | None:
        if final.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.strings, final.prompt_logprobs, k)


class StreamEvents:
    """One streamed job's state: what each choice has been sent so far. ``events(out)`` turns
    the engine's next output into the events to send; ``request_ids``: the engine requests of
    the job's prompts, in order."""

    def __init__(self, responses: Responses, job: GenerationJob, request_ids: list[str]):
        self.r = responses
        self.job, self.shape = job, job.shape
        self.model = job.model_name or responses.model_name  # a LoRA adapter's when one ran
        settings = job.stream
        # vLLM's continuous_usage_stats: each chunk carries its choice's usage so far
        self.continuous_usage = settings is not None and settings.continuous_usage
        self.index_of = {r: i for i, r in enumerate(request_ids)}
        # a stop string may be forming in the last characters: they wait for the next token
        self.hold = job.params.stop_hold
        self.echoed: set[int] = set()  # choices whose echoed prompt is sent
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()
        self.offsets = {}  # choice -> its TextOffsets (a completion's logprobs)
        self.generated = 0  # tokens streamed so far, for the usage chunk

    def is_heavy(self, out: RequestOutput) -> bool:
        """Whether building ``out``'s events is worth a trip to the offload pool: logprobs, an
        echoed prompt, or a finish (whose stop_reason may replay the detokenization)."""
        return self.shape.is_heavy() or out.finished

    def event(self, body: dict) -> str:
        return f"data: {dumps(body)}\n\n"

    def chunk(self, index, text, finish, lp, first=False, stop_reason=None) -> str:
        choice = self.shape.delta_choice(index, text, finish, lp, first)
        choice["stop_reason"] = stop_reason
        body = {
            "id": self.job.response_id,
            "object": self.shape.chunk_kind,
            "created": self.job.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.continuous_usage:
            prompt = self.job.prompts[index // self.job.n]
            body["usage"] = usage([prompt], self.sent_tokens.get(index, 0))
        return f"data: {dumps(body)}\n\n"

    def opening(self) -> list[str]:
        return self.shape.opening(self)

    def usage_event(self) -> str:
        body = {
            "id": self.job.response_id,
            "object": self.shape.chunk_kind,
            "created": self.job.created,
            "model": self.model,
            "choices": [],
            "usage": usage(self.job.prompts, self.generated),
        }
        return self.event(body)

    def events(self, out: RequestOutput) -> list[str]:
        p = self.index_of[out.request_id]
        events = []
        for c in out.outputs:
            index = p * self.job.n + c.index
            if index not in self.done:
                events.extend(self._choice_events(out, p, index, c))
        return events

    def _choice_events(self, out, p, index, c) -> list[str]:
        finish = c.finish_reason
        got = self.shape.stream_head(self, out, p, index, finish)
        if got is None:
            return []
        head, head_lp = got
        if self.shape.prompt_only:  # the prompt alone
            if finish:
                self.done.add(index)
            if head or head_lp or finish:
                return [self.chunk(index, head, "length" if finish else None, head_lp)]
            return []
        start_t, start_k = self.sent_text.get(index, 0), self.sent_tokens.get(index, 0)
        end_t = len(c.text) if finish else max(len(c.text) - self.hold, start_t)
        new_ids = c.token_ids[start_k:]
        lp = None
        if self.shape.k is not None and c.logprobs is not None and new_ids:
            lp = self.shape.stream_logprobs(self, p, index, c, new_ids, c.logprobs[start_k:])
        text, lp = self.shape.with_head(head, head_lp, c.text[start_t:end_t], lp, p)
        self.sent_text[index], self.sent_tokens[index] = end_t, len(c.token_ids)
        self.generated += len(new_ids)
        reason = None
        if finish:
            self.done.add(index)
            reason = c.stop_reason
        if text or lp or finish:
            return [self.chunk(index, text, finish, lp, stop_reason=reason)]
        return []
