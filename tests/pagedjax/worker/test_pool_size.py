"""How many blocks the KV pool gets: ``num_blocks``, else ``kv_cache_space_gib``, else on a GPU or
TPU ``gpu_memory_utilization`` (vLLM's flag) of the allocator's limit less what the weights hold.
This CPU has no such device: the tests give the engine devices whose ``memory_stats`` say what a
GPU's would (``bytes_limit``, ``bytes_in_use``), and check the blocks it sizes from them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hf_models import tiny_llama_dir
from pagedjax.models.config import ModelConfig
from pagedjax.models.llama import kv_pool_bytes_per_block

from pagedjax import LLM, cli
from pagedjax.config import CacheConfig
from pagedjax.worker import kv_cache

GIB = 2**30
BLOCK = 8


@dataclasses.dataclass
class FakeDevice:
    """What ``device_kv_budget`` reads of a device: its platform and its allocator's figures."""

    bytes_limit: int | None
    bytes_in_use: int = 0
    platform: str = "gpu"
    id: int = 0

    def memory_stats(self):
        if self.bytes_limit is None:
            return None
        return {"bytes_limit": self.bytes_limit, "bytes_in_use": self.bytes_in_use}

    def __str__(self):
        return f"cuda:{self.id}"


def test_budget_is_the_share_of_the_limit_less_what_is_in_use():
    h200 = FakeDevice(bytes_limit=105 * GIB, bytes_in_use=16 * GIB)
    assert kv_cache.device_kv_budget(0.9, [h200]) == int(0.9 * 105 * GIB) - 16 * GIB
    assert kv_cache.device_kv_budget(1.0, [h200]) == 89 * GIB


def test_budget_is_the_least_over_the_devices():
    devices = [
        FakeDevice(bytes_limit=80 * GIB, bytes_in_use=8 * GIB, id=0),
        FakeDevice(bytes_limit=80 * GIB, bytes_in_use=9 * GIB, id=1),  # its share is larger
    ]
    assert kv_cache.device_kv_budget(0.5, devices) == 31 * GIB


@pytest.mark.parametrize(
    "devices",
    [[FakeDevice(bytes_limit=GIB, platform="cpu")], [FakeDevice(bytes_limit=None)]],
    ids=["cpu", "no-limit"],
)
def test_no_budget_where_a_device_reports_no_limit(devices):
    assert kv_cache.device_kv_budget(0.9, devices) is None


def test_weights_over_the_share_is_an_error_naming_the_flag():
    device = FakeDevice(bytes_limit=20 * GIB, bytes_in_use=15 * GIB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.7 .*14\.00 GiB.*15\.00 GiB"):
        kv_cache.device_kv_budget(0.7, [device])
    assert kv_cache.device_kv_budget(0.8, [device]) == 1 * GIB


@pytest.mark.parametrize("bad", [0, -0.5, 1.01, float("nan"), float("inf"), True, "0.9", None])
def test_gpu_memory_utilization_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=bad)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--gpu-memory-utilization", "1.5", "gpu_memory_utilization must be"),
        ("--gpu-memory-utilization", "0", "gpu_memory_utilization must be"),
        ("--kv-cache-space-gib", "-1", "kv_cache_space_gib must be"),
        ("--kv-cache-space-gib", "lots", "could not convert string to float: 'lots'"),
    ],
)
def test_cli_refuses_a_bad_memory_flag_before_loading_a_model(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--model", "/nonexistent", flag, value, "--prompt", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err and "/nonexistent" not in err


# ---- the engine sizes its pool from the devices ---------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "pool_size_tiny")


def _block_bytes(tiny) -> int:
    config = ModelConfig.from_hf_dict(json.loads((Path(tiny) / "config.json").read_text()))
    return kv_pool_bytes_per_block(config, BLOCK, "float32")


def _engine_on(monkeypatch, tiny, device, **kwargs) -> LLM:
    budget = kv_cache.device_kv_budget  # given the fake device in place of this CPU
    monkeypatch.setattr(kv_cache, "device_kv_budget", lambda u, _cpu: budget(u, [device]))
    return LLM(tiny, block_size=BLOCK, max_model_len=64, max_num_seqs=4, **kwargs)


def test_engine_pool_takes_the_share_the_weights_leave(monkeypatch, tiny):
    block = _block_bytes(tiny)
    device = FakeDevice(bytes_limit=1000 * block, bytes_in_use=300 * block)
    llm = _engine_on(monkeypatch, tiny, device, gpu_memory_utilization=0.5)
    assert llm.get_stats().num_blocks_total == 200 - 1  # block 0 is the null block
    assert llm.generate([[5, 6, 7]])[0].outputs[0].token_ids  # and it runs


def test_engine_explicit_sizes_win_over_the_share(monkeypatch, tiny):
    block = _block_bytes(tiny)
    device = FakeDevice(bytes_limit=1000 * block, bytes_in_use=300 * block)
    space = 64 * block / GIB
    llm = _engine_on(monkeypatch, tiny, device, kv_cache_space_gib=space)
    assert llm.get_stats().num_blocks_total == 64 - 1
    llm = _engine_on(monkeypatch, tiny, device, num_blocks=40)
    assert llm.get_stats().num_blocks_total == 40 - 1


def test_engine_on_a_full_device_names_the_flag(monkeypatch, tiny):
    block = _block_bytes(tiny)
    device = FakeDevice(bytes_limit=1000 * block, bytes_in_use=950 * block)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9 leaves no memory"):
        _engine_on(monkeypatch, tiny, device)
