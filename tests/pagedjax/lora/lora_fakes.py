"""LoRA fakes for the engine and server tests: a fake runner with adapter slots, a loader that
needs no files, and an engine of the fake model (tests/support/fake_model.py) with LoRA on."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from fake_model import FAKE_CONFIG, FakeRunner
from pagedjax.models.loader import LoadedModel

from pagedjax import LoRARequest
from pagedjax.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.lora import LoRAConfig


class FakeLoRARunner(FakeRunner):
    """The fake runner with adapter slots: records what each slot was loaded with, and the
    ``lora_slot`` of every sequence a step ran (where the step loop passes one)."""

    def __init__(self, config, params, sizes, **kwargs):
        super().__init__(config, params, sizes, **kwargs)
        self.lora_config = sizes.lora
        # the device slots' stand-in: writing one records it (load_lora_slot, which tests
        # override)
        self.lora = None if sizes.lora is None else SimpleNamespace(load=self.load_lora_slot)
        self.slot_loads: list[tuple[int, str]] = []
        self.seen_slots: list[int | None] = []

    def load_lora_slot(self, slot: int, adapter) -> None:
        assert 1 <= slot <= self.lora_config.max_loras
        self.slot_loads.append((slot, adapter.path))

    def execute(self, seqs, num_top_logprobs: int = 0):
        self.seen_slots += [getattr(s, "lora_slot", None) for s in seqs]
        return super().execute(seqs, num_top_logprobs)


def fake_loader(path: str, model_config, max_rank: int):
    """Paths ".../rank<r>" load an adapter of rank r; others have no adapter."""
    if "rank" not in path:
        raise ValueError(f"{path!r} holds no adapter_config.json")
    rank = int(path.rsplit("rank", 1)[1])
    if rank > max_rank:
        raise ValueError(f"rank {rank} of {path!r} exceeds max_lora_rank={max_rank}")
    return SimpleNamespace(rank=rank, path=path)


def lora_engine(runner=FakeLoRARunner, loader=fake_loader, enable_lora=True, **lora) -> LLMEngine:
    config = EngineConfig(
        model="fake",
        cache=CacheConfig(8, 64, None, 0.001, True),
        scheduler=SchedulerConfig(8, 64),
        lora=LoRAConfig(**({"max_loras": 2, "max_lora_rank": 8} | lora)) if enable_lora else None,
    )
    loaded = LoadedModel(config=FAKE_CONFIG, params={}, source="fake", tokenizer_dir=None)
    return LLMEngine(config, loaded, runner_factory=runner, lora_loader=loader)


def adapter(i: int, rank: int = 4) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}/rank{rank}")


def adapter_dir(root: Path, name: str) -> str:
    """A directory that passes a server's check of run-time adapter paths (an
    adapter_config.json and a weight file, which fake_loader does not read)."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text("{}")
    (directory / "adapter_model.safetensors").write_bytes(b"")
    return str(directory)
