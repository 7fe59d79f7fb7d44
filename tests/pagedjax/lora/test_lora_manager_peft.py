"""LoRAManager's default loader (pagedjax.models.lora.load_adapter) on adapters saved by PEFT
for a tiny random Llama: loaded into the host cache, a rank above max_lora_rank and a path that
holds no adapter refused with a ValueError naming them."""

from __future__ import annotations

import copy
import json

import peft
import pytest
from hf_models import make_tiny_model
from pagedjax.models.config import ModelConfig

from pagedjax import LoRARequest
from pagedjax.lora import LoRAConfig, LoRAManager


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_peft")
    hf = make_tiny_model("llama_gqa", root / "base")
    dirs = {}
    for rank in (8, 32):
        config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        peft.get_peft_model(copy.deepcopy(hf), config).save_pretrained(str(root / f"rank{rank}"))
        dirs[rank] = str(root / f"rank{rank}")
    config = ModelConfig.from_hf_dict(json.loads((root / "base" / "config.json").read_text()))
    return config, dirs, root


def test_peft_adapters_load_through_the_default_loader(base_and_adapters):
    config, dirs, root = base_and_adapters
    slots = []
    limits = LoRAConfig(max_loras=1, max_lora_rank=16)
    m = LoRAManager(limits, model_config=config, load_slot=lambda s, a: slots.append(a))
    assert m.add_lora(LoRARequest("r8", 1, dirs[8]))
    assert m.activate(LoRARequest("r8", 1, dirs[8]), set()) == 1
    assert slots[0].rank == 8 and slots[0].target_modules
    with pytest.raises(ValueError, match="32"):
        m.add_lora(LoRARequest("r32", 2, dirs[32]))
    with pytest.raises(ValueError, match="base"):
        m.add_lora(LoRARequest("base", 3, str(root / "base")))  # no adapter_config.json there
    with pytest.raises(ValueError, match="nowhere"):
        m.add_lora(LoRARequest("none", 4, str(root / "nowhere")))
    assert m.list_loras() == {1}
