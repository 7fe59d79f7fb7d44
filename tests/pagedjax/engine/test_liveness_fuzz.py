"""Liveness fuzzer: the real scheduler, block manager and engine over a fake model (no compile).

Each case draws a tight configuration (block size, pool, swap space, token budget, chunking,
max_num_seqs, preemption mode) and a random mix of requests (n samples, beams, stop tokens,
EOS, aborts, arrivals over time). It must end, within a step bound computed from the work, with
every request finished or refused up front, no request in any queue and no block held; and every
finished sampling request must carry exactly the tokens the fake model gives it alone.
"""

from __future__ import annotations

import random

import pytest
from fake_model import EOS, VOCAB, fake_engine, next_token

from pagedjax import BeamSearchParams, SamplingParams
from pagedjax.engine.request import GOLDEN, Request

SEEDS_PER_CHUNK = 50
# The only reason the engine may end a request it accepted: several sequences had to be
# preempted while the swap space was held by others (they cannot be recomputed).
ALLOWED_ABORT = "found no free swap space"


def _reference(prompt, p: SamplingParams, seed: int, max_model_len: int):
    ctx, out = list(prompt), []
    while True:
        t = next_token(ctx, seed if p.temperature > 0 else 0)
        ctx.append(t)
        out.append(t)
        if (not p.ignore_eos and t == EOS) or t in p.stop_token_ids:
            return out, "stop"
        if len(out) >= p.max_tokens or len(ctx) >= max_model_len:
            return out, "length"


def _draw_config(rng: random.Random) -> dict:
    block_size = rng.choice([8, 16])
    return dict(
        block_size=block_size,
        num_blocks=rng.randint(2, 16),
        num_host_blocks=rng.choice([0, 0, rng.randint(1, 8), rng.randint(8, 64)]),
        max_model_len=rng.randint(2, rng.choice([3, 6]) * block_size),
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([None, rng.randint(1, 12), rng.randint(8, 128)]),
        enable_chunked_prefill=rng.random() < 0.7,
        enable_prefix_caching=rng.random() < 0.6,
        preemption_mode=rng.choice(["recompute", "swap", "auto"]),
        seed=rng.randint(0, 99),
    )


def _draw_request(rng: random.Random, max_model_len: int):
    prompt_len = rng.randint(1, max_model_len + 4 if rng.random() < 0.2 else 24)
    prefix = [5] * rng.choice([0, 0, 8, 16])  # shared prefixes exercise prefix caching
    prompt = (prefix + [rng.randrange(3, VOCAB) for _ in range(prompt_len)])[: max(prompt_len, 1)]
    max_tokens = rng.randint(1, 2 * max_model_len if rng.random() < 0.3 else 24)
    if rng.random() < 0.15:
        return prompt, BeamSearchParams(
            beam_width=rng.randint(1, 4), max_tokens=max_tokens, ignore_eos=rng.random() < 0.5
        )
    return prompt, SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3, 5]),
        max_tokens=max_tokens,
        temperature=rng.choice([0.0, 1.0]),
        seed=rng.randrange(2**40),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=rng.sample(range(3, VOCAB), rng.choice([0, 0, 1, 2])),
    )


def run_case(case_seed: int) -> dict:
    """One fuzz case; raises AssertionError naming what went wrong. Returns counts."""
    rng = random.Random(case_seed)
    cfg = _draw_config(rng)
    try:
        engine = fake_engine(**cfg)
    except ValueError:
        return {"config_refused": 1}
    max_len = cfg["max_model_len"]
    arrivals = sorted(
        (rng.randint(0, 8), i, *_draw_request(rng, max_len)) for i in range(rng.randint(1, 12))
    )
    aborts = {rng.randrange(len(arrivals)): rng.randint(0, 40) for _ in range(rng.randint(0, 2))}

    accepted, refused, outputs, client_aborted = {}, 0, {}, set()
    work = 0
    step, idle_steps = 0, 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, i, prompt, params = arrivals.pop(0)
            before = (len(engine.requests), engine.block_manager.get_stats().num_blocks_used)
            try:
                engine.add_request(f"r{i}", prompt, params)
            except ValueError:
                refused += 1
                after = (len(engine.requests), engine.block_manager.get_stats().num_blocks_used)
                assert after == before, "a refused request changed the engine"
                continue
            accepted[f"r{i}"] = (prompt, params)
            width = params.max_num_seqs
            work += len(prompt) + width * min(params.max_tokens, max_len) + 1
        for i, at in list(aborts.items()):
            if at <= step and f"r{i}" in accepted:
                engine.abort_request(f"r{i}")
                client_aborted.add(f"r{i}")
                del aborts[i]
        bound = 64 + 4 * work * (len(accepted) + 1)
        assert step <= bound, f"no end after {step} steps (bound {bound}): {cfg}"
        if not engine.has_unfinished_requests():
            step += 1
            continue
        runs_before = engine.runner.num_steps
        for out in engine.step():
            if out.finished:
                assert out.request_id not in outputs, f"{out.request_id} finished twice"
                outputs[out.request_id] = out
        idle_steps = 0 if engine.runner.num_steps > runs_before else idle_steps + 1
        assert idle_steps <= 3, f"the engine spins without running anything: {cfg}"
        step += 1

    # Nothing is left anywhere.
    sched, bm = engine.scheduler, engine.block_manager
    assert not (sched.waiting or sched.running or sched.swapped) and not engine.requests
    assert bm.get_stats().num_blocks_used == 0, "device blocks leaked"
    assert bm.get_num_free_host_blocks() == bm.num_host_blocks, "host blocks leaked"
    assert not bm.block_tables and not bm.host_block_tables

    num_engine_aborts = 0
    for request_id, (prompt, params) in accepted.items():
        if request_id in client_aborted and request_id not in outputs:
            continue
        out = outputs.get(request_id)
        assert out is not None, f"{request_id} never finished: {cfg}"
        if out.error is not None:
            assert ALLOWED_ABORT in out.error, out.error
            assert all(c.finish_reason == "abort" for c in out.outputs)
            num_engine_aborts += 1
            continue
        assert out.outputs, f"{request_id} finished with no output"
        if isinstance(params, BeamSearchParams):
            assert len(out.outputs) <= params.beam_width
            assert all(len(c.token_ids) <= params.max_tokens for c in out.outputs)
            assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
            continue
        assert len(out.outputs) == params.n
        base = (params.seed ^ (params.seed >> 32)) & 0xFFFFFFFF
        for c in out.outputs:
            want = _reference(prompt, params, (base + c.index * GOLDEN) % 2**32, max_len)
            assert (c.token_ids, c.finish_reason) == want, (request_id, c.index, cfg)
    return {
        "accepted": len(accepted),
        "refused": refused,
        "engine_aborts": num_engine_aborts,
        "preemptions": engine.scheduler.num_preemptions,
        "swaps": engine.scheduler.num_swapped,
    }


def _run_seeds(seeds) -> dict:
    totals: dict[str, int] = {}
    for seed in seeds:
        try:
            counts = run_case(seed)
        except AssertionError as e:
            raise AssertionError(f"fuzz case seed={seed}: {e}") from e
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
    return totals


@pytest.mark.parametrize("chunk", range(6))
def test_liveness_fuzz(chunk):
    totals = _run_seeds(range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK))
    assert totals.get("accepted", 0) > 0


@pytest.mark.slow
def test_liveness_fuzz_long():
    totals = _run_seeds(range(1000, 4000))
    assert totals["preemptions"] > 0 and totals["swaps"] > 0


def test_a_request_failing_in_a_step_ends_alone_with_abort(monkeypatch):
    """Its output is finished, says why, and every completion reads "abort"; the other request
    gets the tokens it would get alone."""
    engine = fake_engine(num_blocks=32, num_host_blocks=16, max_model_len=64)
    original = Request.sampling_rows

    def sampling_rows(req, chunk, vocab_size):
        if req.request_id == "bad" and chunk.seq.get_output_len() >= 2:
            raise RuntimeError("planted failure")
        return original(req, chunk, vocab_size)

    monkeypatch.setattr(Request, "sampling_rows", sampling_rows)
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request("bad", [5, 6, 7], params)
    engine.add_request("good", [8, 9], params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    bad, good = outs["bad"], outs["good"]
    assert "planted failure" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["abort", "abort"]
    assert all(len(c.token_ids) == 2 for c in bad.outputs)
    assert good.error is None
    for c in good.outputs:
        want = _reference([8, 9], params, (7 + c.index * GOLDEN) % 2**32, 64)
        assert (c.token_ids, c.finish_reason) == want
    assert engine.block_manager.get_stats().num_blocks_used == 0
    assert engine.get_stats().num_aborted == 1
