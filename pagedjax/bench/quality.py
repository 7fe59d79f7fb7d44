"""Quality of a quantized model against its unquantized reference, by teacher forcing: both score
the same token sequence in one prefill (logits at every position), and we compare each position's
next-token choice (top-1 agreement) and distributions (KL(reference || quantized), float64).
"""

from __future__ import annotations

import numpy as np

from pagedjax.worker.runner import Runner, ScheduledSeq


def teacher_forced_logits(runner: Runner, tokens: list[int]) -> np.ndarray:
    """f32[len(tokens), vocab]: the logits after each prefix of ``tokens`` (one prefill into
    blocks 1, 2, ... of ``runner``'s pool)."""
    blocks = -(-len(tokens) // runner.block_size)
    table = list(range(1, 1 + blocks))
    return np.asarray(
        runner.forward_logits([ScheduledSeq(list(tokens), 0, table)], all_positions=True)
    )


def compare(ref: np.ndarray, logits: np.ndarray) -> dict:
    """Top-1 agreement and mean KL(softmax(ref) || softmax(logits)) over the rows."""
    ref, logits = ref.astype(np.float64), logits.astype(np.float64)
    log_p = ref - _logsumexp(ref)
    log_q = logits - _logsumexp(logits)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    top1 = np.mean(ref.argmax(-1) == logits.argmax(-1))
    return {"top1": float(top1), "mean_kl": float(kl.mean()), "positions": len(ref)}


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))
