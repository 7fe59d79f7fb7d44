"""A soak against a real ``pagedjax serve`` process (issue 41; its parts in
tests/support/server_soak.py): 200 hostile bodies next to 64 normal greedy streams. The server
must stay up, every hostile body must get an answer below 500, every normal stream must finish
with the text it has alone, and the KV pool must be empty afterwards. How much longer the normal
streams take in the flood than alone is a measurement, not a pass/fail check here:
benchmarks/server_soak.py reports it.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import types

import pytest
from server_helpers import raw, wait_idle
from server_soak import (
    KEY,
    compilations,
    run_mixed,
    run_normal,
    served,
    wait_background_compile,
)


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """One soak run: the mix once untimed (so that every program it needs, prompt logprobs,
    grammar masks and its batch shapes, is compiled before anything is timed), the server's
    background compile finished, the normal streams alone, then the same mix timed."""
    with served(tmp_path_factory.mktemp("soak")) as (base, proc, log):
        with concurrent.futures.ThreadPoolExecutor(8) as normal_pool:
            texts, _, warm_statuses, _ = run_mixed(base, normal_pool, seed=0)
            wait_background_compile(base)
            alone_texts, alone = run_normal(base, normal_pool)
            compiled = compilations(base)
            mixed_texts, mixed, statuses, unanswered = run_mixed(base, normal_pool, seed=0)
            compiled = compilations(base) - compiled
        alive = proc.poll() is None
        health = alive and raw(base, "GET", "/health", key=None, timeout=10)[0] == 200
        kv_used = (
            wait_idle(base, timeout=120, key=KEY)["pagedjax_kv_blocks_used"] if alive else None
        )
        log_tail = log.read_text()[-3000:]
    result = types.SimpleNamespace(
        texts=texts,
        warm_statuses=warm_statuses,
        alone_texts=alone_texts,
        alone=alone,
        mixed_texts=mixed_texts,
        mixed=mixed,
        statuses=statuses,
        unanswered=unanswered,
        compiled=compiled,
        alive=alive,
        health=health,
        kv_used=kv_used,
        log_tail=log_tail,
    )
    print(
        f"hostile statuses {sorted(statuses)[::20]}; normal latency alone median "
        f"{statistics.median(alone):.3f} max {max(alone):.3f} s, mixed median "
        f"{statistics.median(mixed):.3f} max {max(mixed):.3f} s; compiled during the timed mix: "
        f"{compiled}; hostile bodies unanswered when the streams ended: {unanswered}"
    )
    return result


@pytest.mark.slow
def test_hostile_bodies_leave_the_server_up_and_normal_streams_whole(soak):
    assert soak.alive and soak.health, soak.log_tail
    for statuses in (soak.warm_statuses, soak.statuses):
        assert all(s < 500 for s in statuses), statuses
    assert soak.texts == soak.alone_texts == soak.mixed_texts  # every stream, the same text
    assert soak.unanswered > 0  # the normal streams ran in the midst of the flood
    assert soak.kv_used == 0
