"""A seeded ShareGPT-like workload: lognormal prompt and output lengths.

The means follow the ShareGPT figures of the vLLM paper (Kwon et al., 2023, fig. 11: 161 input
and 338 output tokens on average) with a heavy lognormal tail; lengths are clipped so that every
request fits max_model_len. Pure numpy; imports no jax.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SHAREGPT_MEAN_PROMPT_LEN = 161.0
SHAREGPT_MEAN_OUTPUT_LEN = 338.0
SIGMA = 1.0  # log-space spread of both lengths


@dataclasses.dataclass(frozen=True)
class RequestLengths:
    prompt_len: int
    output_len: int


def _lognormal(rng: np.random.Generator, mean: float, size: int) -> np.ndarray:
    mu = math.log(mean) - SIGMA**2 / 2  # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    return rng.lognormal(mu, SIGMA, size)


def sharegpt_like(
    num_requests: int, *, max_model_len: int = 2048, seed: int = 0
) -> list[RequestLengths]:
    """num_requests (prompt_len, output_len) pairs, the same for the same seed; each is >= 1 and
    prompt_len + output_len <= max_model_len."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    rng = np.random.default_rng(seed)
    prompt = _lognormal(rng, SHAREGPT_MEAN_PROMPT_LEN, num_requests)
    output = _lognormal(rng, SHAREGPT_MEAN_OUTPUT_LEN, num_requests)
    prompt = np.clip(np.rint(prompt), 1, max_model_len - 1).astype(int)
    output = np.clip(np.rint(output), 1, max_model_len - prompt).astype(int)
    return [RequestLengths(int(p), int(o)) for p, o in zip(prompt, output, strict=True)]
