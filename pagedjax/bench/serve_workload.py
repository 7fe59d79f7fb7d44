"""The workload of ``pagedjax bench serve``: prompts as text with their token lengths, requested
output lengths, and arrival times. Pure Python + numpy; the tokenizer is passed in.

Three sources, all seeded:
- ``sharegpt-like``: the lognormal lengths of ``pagedjax bench throughput`` (ShareGPT means),
  clipped to --max-prompt-len / --max-output-len, with random-token prompts of exactly that length;
- ``random``: every prompt exactly --random-input-len tokens and every output
  --random-output-len (each drawn from [len * (1 - r), len * (1 + r)] with --random-range-ratio r);
- ``json``: a file of requests, either ``[{"prompt": text or token ids, "output_len": n}]`` (the
  format ``pagedjax bench throughput --dataset`` reads) or ShareGPT conversations
  (``[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}]``,
  the output length being the reply's token count).

Prompts are sent as text, so every server tokenizes the same string. A random prompt is made
from random non-special token ids, decoded and re-encoded until the server-side tokenization
(``tokenizer(text)``, special tokens included) has exactly the wanted length.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from pagedjax.bench.workload import sharegpt_like

DATASETS = ("sharegpt-like", "random", "json")


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str  # sent as the completion prompt, or as the chat user message
    prompt_len: int  # tokens of ``tokenizer(prompt)`` (the chat template adds its own)
    output_len: int  # max_tokens; exact when the server ignores EOS


def load_tokenizer(source: str):
    """A tokenizer from a .gguf file (read without torch), a directory or a hub id."""
    if source.endswith(".gguf"):
        from pagedjax.models.loader import gguf_tokenizer

        return gguf_tokenizer(source)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of a generated text (no special tokens added): for servers that send no usage."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


class PromptMaker:
    """Text prompts of an exact token length, from random token ids that survive a round trip
    alone (``encode(decode([t])) == [t]``: no special tokens, no partial UTF-8 bytes)."""

    def __init__(self, tokenizer, seed: int):
        self.tok = tokenizer
        self.rng = np.random.default_rng(seed)
        special = set(tokenizer.all_special_ids)
        candidates = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in candidates])
        encs = tokenizer(texts, add_special_tokens=False)["input_ids"]
        stable = [i for i, e in zip(candidates, encs, strict=True) if e == [i]]
        self.ids = np.array(stable or candidates)
        self.added = len(tokenizer("")["input_ids"])  # BOS and the like, added by the server

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _draw(self, n: int) -> list[int]:
        return self.rng.choice(self.ids, n).tolist()

    def make(self, length: int) -> BenchRequest:
        """A prompt of ``length`` tokens as the server counts them (at least the added ones);
        if no draw converges, the closest one, with its true length."""
        body = max(length - self.added, 0)
        best = None
        for _ in range(8):  # fresh draws
            ids = self._draw(body)
            for _ in range(8):  # neighbours may merge or split: trim or top up, re-encode
                text = self.tok.decode(ids)
                enc = self._encode(text)
                if best is None or abs(len(enc) - body) < abs(best[1] - body):
                    best = (text, len(enc))
                if len(enc) == body:
                    return BenchRequest(text, len(self.tok(text)["input_ids"]), 0)
                ids = enc[:body] if len(enc) > body else enc + self._draw(body - len(enc))
        text = best[0]
        return BenchRequest(text, len(self.tok(text)["input_ids"]), 0)


def _with_output(req: BenchRequest, output_len: int) -> BenchRequest:
    return dataclasses.replace(req, output_len=int(output_len))


def sharegpt_like_requests(
    tokenizer, num: int, max_prompt_len: int, max_output_len: int, seed: int
) -> list[BenchRequest]:
    lengths = sharegpt_like(num, max_model_len=max_prompt_len + max_output_len, seed=seed)
    maker = PromptMaker(tokenizer, seed + 1)
    return [
        _with_output(
            maker.make(min(r.prompt_len, max_prompt_len)), min(r.output_len, max_output_len)
        )
        for r in lengths
    ]


def random_requests(
    tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def draw(n: int) -> np.ndarray:
        lo, hi = max(1, math.floor(n * (1 - range_ratio))), max(1, math.ceil(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, num)

    ins, outs = draw(input_len), draw(output_len)
    maker = PromptMaker(tokenizer, seed + 1)
    return [_with_output(maker.make(int(i)), int(o)) for i, o in zip(ins, outs, strict=True)]


def _sharegpt_item(item: dict, tokenizer) -> tuple[str, int] | None:
    turns = item.get("conversations") or item.get("conversation")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    prompt, reply = turns[0].get("value"), turns[1].get("value")
    if not isinstance(prompt, str) or not isinstance(reply, str):
        return None
    return prompt, count_tokens(tokenizer, reply)


def json_requests(
    path: str, tokenizer, num: int | None, max_prompt_len: int, max_output_len: int
) -> list[BenchRequest]:
    """Requests from a JSON file (see the module doc); prompts longer than max_prompt_len tokens
    and conversations with an empty reply are skipped, outputs clipped to max_output_len."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: {e}") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"--dataset-path {path}: expected a non-empty JSON list")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"--dataset-path {path}: item {i} is not an object")
        if "prompt" in item:
            prompt, output_len = item["prompt"], item.get("output_len")
            if not isinstance(prompt, str):
                prompt = tokenizer.decode(list(prompt))
            if not isinstance(output_len, int) or output_len < 1:
                raise ValueError(f"--dataset-path {path}: item {i} needs an output_len >= 1")
        else:
            parsed = _sharegpt_item(item, tokenizer)
            if parsed is None:
                raise ValueError(
                    f"--dataset-path {path}: item {i} has neither 'prompt' nor 'conversations'"
                )
            prompt, output_len = parsed
        prompt_len = len(tokenizer(prompt)["input_ids"])
        if not prompt or output_len < 1 or prompt_len > max_prompt_len:
            continue
        out.append(BenchRequest(prompt, prompt_len, min(output_len, max_output_len)))
        if num is not None and len(out) == num:
            break
    if not out:
        raise ValueError(
            f"--dataset-path {path}: no request fits --max-prompt-len {max_prompt_len}"
        )
    return out


def arrival_times(num: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send offsets (s) from the start: all 0 for an infinite rate, else gaps drawn from a gamma
    distribution of mean 1 / rate and shape ``burstiness`` (1: Poisson; lower: burstier), as
    ``vllm bench serve`` draws them. The first request goes at 0."""
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate) or num == 0:
        return np.zeros(num)
    rng = np.random.default_rng(seed + 2)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps)
