"""pagedjax on Ray Serve (pagedjax.entrypoints.serve_ray): two CPU replicas of a tiny model on a
local Ray cluster (loopback only) behind the ingress, driven by the official openai client."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import types

import openai
import pytest
from hf_models import tiny_llama_dir
from ingress_cases import SERVER_KWARGS, check_all
from server_helpers import free_port, live_server

from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.serve_ray.options import (
    AutoscalingOptions,
    RayServeOptions,
    builder_arguments,
)
from pagedjax.entrypoints.serve_ray.prefix_key import BLOCK_CHARS, block_hashes, prompt_text

MAX_MODEL_LEN = 128
LLM_KWARGS = {"block_size": 8, "num_blocks": 160, "max_model_len": MAX_MODEL_LEN, "seed": 0}
PROMPTS = ["w5 w6 w7 w8", "w100 w3 w9", "w42 w43 w44 w45 w46 w47"]


# ---- without a cluster ------------------------------------------------------------------------


def test_block_hashes_share_exactly_the_shared_prefix_blocks():
    a = "x" * (3 * BLOCK_CHARS) + "tail a"
    b = "x" * (2 * BLOCK_CHARS) + "y" * BLOCK_CHARS
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == len(hb) == 3
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert block_hashes("short") != block_hashes("other") and block_hashes("") == []
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert prompt_text(chat) and prompt_text(b"not json") == ""
    assert prompt_text(json.dumps({"prompt": ["p"]}).encode()) == "p"


def test_options_refuse_bad_values_and_name_them():
    with pytest.raises(ValueError, match="routing"):
        RayServeOptions(routing="round-robin")
    with pytest.raises(ValueError, match="num_replicas"):
        RayServeOptions(num_replicas=0)
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscalingOptions(min_replicas=2, max_replicas=1)
    opts = RayServeOptions(autoscaling=AutoscalingOptions()).replica_deployment_options()
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 2


# ---- on a local Ray cluster -------------------------------------------------------------------

try:
    import ray
    from ray import serve
except ImportError:  # the ray extra is not installed: only the tests above run
    ray = serve = None


def test_serve_run_arguments_become_options():
    """``serve run pagedjax.entrypoints.serve_ray.app:app_builder key=value ...`` passes strings."""
    args = {"model": "m", "num_replicas": "3", "num_gpus": "2", "routing": "random"}
    model, options, kw = builder_arguments({**args, "llm_kwargs": '{"tensor_parallel_size": 2}'})
    assert model == "m" and kw["llm_kwargs"] == {"tensor_parallel_size": 2}
    ray_opts = options.replica_deployment_options()
    assert ray_opts["num_replicas"] == 3 and ray_opts["ray_actor_options"]["num_gpus"] == 2.0
    _, scaled, _ = builder_arguments({"model": "m", "autoscaling": {"max_replicas": 4}})
    assert scaled.replica_deployment_options()["autoscaling_config"]["max_replicas"] == 4
    with pytest.raises(ValueError, match="routing"):
        builder_arguments({"model": "m", "routing": "nearest"})
    with pytest.raises(ValueError, match="model"):
        builder_arguments({"num_replicas": 2})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "serve_ray_llama", tokenizer=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if ray is None:
        pytest.skip("needs the ray extra: pip install 'pagedjax[ray]'")
    cache = tmp_path_factory.getbasetemp().parent / "pagedjax-jax-cache"
    env = {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache)}
    env["PAGEDJAX_CACHE_DIR"] = os.environ.get("PAGEDJAX_CACHE_DIR", str(cache))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": env},
        _node_ip_address="127.0.0.1",
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _deploy(cluster, model_dir, name, options, server_kwargs=None):
    from pagedjax.entrypoints.serve_ray.app import build

    app = build(
        model_dir,
        options,
        served_model_name="tiny",
        llm_kwargs=LLM_KWARGS,
        server_kwargs=server_kwargs,
        startup_kwargs={"warmup": False},
    )
    serve.run(app, name=name, route_prefix=f"/{name}")
    client = openai.OpenAI(
        base_url=f"{cluster}/{name}/v1", api_key="none", max_retries=0, timeout=120
    )
    engine = serve.get_deployment_handle("PagedJaxEngine", app_name=name)
    return types.SimpleNamespace(client=client, engine=engine, name=name, base=f"{cluster}/{name}")


def _replicas(engine, want: int, timeout_s: float = 180) -> dict[str, dict]:
    """engine_info of ``want`` distinct replicas (random routing reaches each)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only {len(seen)} of {want} replicas answered"
        info = engine.engine_info.remote(routing="random").result(timeout_s=60)
        seen[info["replica_id"]] = info
    return seen


TWO = RayServeOptions(num_replicas=2, num_cpus=0.5, routing="prefix", routing_stats_period_s=0.5)


@pytest.fixture(scope="module")
def two(cluster, model_dir):
    dep = _deploy(cluster, model_dir, "two", TWO)
    _replicas(dep.engine, 2)
    yield dep
    serve.delete("two")


@pytest.mark.slow
def test_the_ingress_answers_hostile_bodies_cors_and_head_like_the_plain_server(cluster, model_dir):
    """tests/support/ingress_cases.py, which the plain server answers (test_ingress_cases.py): deep
    nesting a 400 (a RecursionError in the routing key was a 500), a body over the limit a 413
    from the ingress itself, CORS preflights and HEAD /health answered (both were 405)."""
    one = RayServeOptions(num_replicas=1, num_cpus=0.5, routing="prefix")
    dep = _deploy(cluster, model_dir, "cases", one, server_kwargs=SERVER_KWARGS)
    try:
        _replicas(dep.engine, 1)
        check_all(dep.base, "tiny")
    finally:
        serve.delete("cases")


@pytest.mark.slow
def test_greedy_tokens_match_the_plain_server(two, model_dir):
    from pagedjax import LLM
    from pagedjax.entrypoints.api_server import build_app

    llm = LLM(model_dir, **LLM_KWARGS)
    with live_server(build_app(EngineLoop(llm.engine), "tiny")) as base:
        plain = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            kw = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
            want = plain.completions.create(**kw).choices[0].text
            assert two.client.completions.create(**kw).choices[0].text == want
            streamed = two.client.completions.create(**kw, stream=True)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    llm.close()


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_aborts_its_request_on_the_replica(two):
    def aborted():
        return sum(r["aborted"] for r in _replicas(two.engine, 2).values())

    before = aborted()
    kw = {"model": "tiny", "prompt": "w9 w10", "max_tokens": 120, "temperature": 0}
    for _ in range(2):
        stream = two.client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
    _wait_for(lambda: aborted() == before + 2, 60, "the replicas to abort both requests")


def _hit_rate(engine, workload, routing) -> float:
    before = _replicas(engine, 2)
    for prompt in workload:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
        call = ("POST", "/v1/completions", b"", [("content-type", "application/json")], body)
        gen = engine.options(stream=True).handle.remote(
            *call, prefix=block_hashes(prompt), routing=routing
        )
        items = list(gen)
        assert items[0]["status"] == 200, items
    after = _replicas(engine, 2)
    hits = {r: after[r]["prefix_cache_hits"] - before[r]["prefix_cache_hits"] for r in after}
    queries = {
        r: after[r]["prefix_cache_queries"] - before[r]["prefix_cache_queries"] for r in after
    }
    assert all(queries.values()), f"{routing} routing left a replica idle: {queries}"
    return sum(hits.values()) / sum(queries.values())


def _shared_prefix_workload(first_word: int, groups: int = 12, per_group: int = 4) -> list[str]:
    """``groups`` prefixes of 40 words, each followed by ``per_group`` different suffixes."""
    out = []
    for g in range(groups):
        prefix = " ".join(f"w{3 + (first_word + g * 41 + i) % 250}" for i in range(40))
        out += [f"{prefix} w{10 + s} w{20 + s}" for s in range(per_group)]
    return out


@pytest.mark.slow
def test_prefix_aware_routing_hits_the_prefix_cache_more_than_random(two):
    """Both policies use both replicas (checked); prefix-aware keeps each group on one."""
    prefix = _hit_rate(two.engine, _shared_prefix_workload(0), "prefix")
    random_ = _hit_rate(two.engine, _shared_prefix_workload(7), "random")
    print(f"prefix-cache hit rate: prefix-aware {prefix:.3f}, random {random_:.3f}")
    assert prefix > random_, (prefix, random_)


def _stream_one(client, i, first_token: threading.Event, on_replica: str | None = None):
    """("ok" | "error", replica header, error message) of one streamed completion; sets
    ``first_token`` when a token arrives (from the replica ``on_replica``, if given)."""
    kw = {"model": "tiny", "prompt": f"w{5 + i % 200} w7 w8", "max_tokens": 32, "temperature": 0}
    try:
        raw = client.completions.with_raw_response.create(
            **kw, stream=True, extra_body={"ignore_eos": True}
        )
        replica = raw.headers.get("x-pagedjax-replica")
        text = ""
        for chunk in raw.parse():
            text += "".join(c.text for c in chunk.choices)
            if on_replica in (None, replica):
                first_token.set()
        return ("ok" if text else "empty", replica, "")
    except openai.APIError as e:
        return ("error", None, str(e))


@pytest.mark.slow
def test_a_killed_replica_fails_only_its_own_requests_and_comes_back(two):
    before = _replicas(two.engine, 2)
    victim_id, victim = next(iter(before.items()))
    first_token = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        # killed once one of its own streams is under way (a token from the other replica
        # first let the victim finish all of its streams before the kill, under load)
        futs = [pool.submit(_stream_one, two.client, i, first_token, victim_id) for i in range(64)]
        assert first_token.wait(180), "no request on the victim produced a token"
        os.kill(victim["pid"], signal.SIGKILL)
        done, hanging = concurrent.futures.wait(futs, timeout=300)
    assert not hanging, f"{len(hanging)} requests hang"
    results = [f.result() for f in futs]
    survivor = [r for r in results if r[1] is not None and r[1] != victim_id]
    assert survivor and all(r[0] == "ok" for r in survivor), results
    failed = [r for r in results if r[0] != "ok"]
    assert all("replica failed" in r[2] for r in failed), failed
    assert failed and len(failed) < 64  # the kill cut the victim's streams, and only those
    back = _replicas(two.engine, 2, timeout_s=300)  # Ray Serve replaced the dead one
    assert victim_id not in back and len(back) == 2


def _running_replicas(app: str) -> int:
    dep = serve.status().applications[app].deployments["PagedJaxEngine"]
    return dep.replica_states.get("RUNNING", 0)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_autoscaling_goes_from_one_to_two_replicas_under_a_burst_and_back(cluster, model_dir):
    scale = AutoscalingOptions(
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=2,
        upscale_delay_s=0.5,
        downscale_delay_s=3,
        look_back_period_s=1,
        metrics_interval_s=0.5,
    )
    options = RayServeOptions(num_cpus=0.25, autoscaling=scale)
    dep = _deploy(cluster, model_dir, "auto", options)
    try:
        assert _running_replicas("auto") == 1
        stop = threading.Event()

        def burst():  # 8 long requests at a time until two replicas run
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                while not stop.is_set():
                    list(
                        pool.map(lambda i: _stream_one(dep.client, i, threading.Event()), range(8))
                    )

        worker = threading.Thread(target=burst, daemon=True)
        worker.start()
        _wait_for(lambda: _running_replicas("auto") == 2, 300, "a second replica")
        stop.set()
        worker.join(timeout=300)
        assert not worker.is_alive(), "the burst's requests hang"
        _wait_for(lambda: _running_replicas("auto") == 1, 120, "the scale-down to one replica")
    finally:
        serve.delete("auto")
