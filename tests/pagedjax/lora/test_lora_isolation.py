"""One adapter's NaN or inf never reaches another row: the batched LoRA product selects each
row's own slot (models/lora_slots.py ``lora_delta``), so a slot holding non-finite weights
poisons its own rows only, never the base model's, another adapter's or padding; and adapters
whose weights are not finite (in float32 after scaling, or in the slots' dtype) are refused at
load with a ValueError naming the adapter and the tensor, offline and in the engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import hf_greedy
from lora_peft import build
from pagedjax.models import lora as model_lora
from pagedjax.models import lora_slots
from pagedjax.models.loader import load_model
from pagedjax.models.lora import init_slots, load_adapter
from pagedjax.models.lora_slots import check_adapter_fits, lora_delta
from safetensors.numpy import load_file, save_file

from pagedjax import LLM, LoRARequest, SamplingParams
from pagedjax.worker import lora as worker_lora

WEIGHTS = "adapter_model.safetensors"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _delta_reference(x, a, b, slots) -> np.ndarray:
    """Row by row, in float64: (x[t] @ a[s]) @ b[s], zero for slot 0."""
    out = np.zeros((x.shape[0], b.shape[2]))
    for t, s in enumerate(slots):
        if s:
            out[t] = (x[t].astype(np.float64) @ a[s]) @ b[s]
    return out


def test_a_non_finite_slot_reaches_no_other_row():
    """Slot 2 holds a NaN in a and an inf in b: rows of slots 0 (the base model, and padding),
    1 and 3 get exactly their own products; slot 2's rows alone are not finite."""
    rng = np.random.default_rng(0)
    num_slots, n_in, rank, n_out = 4, 12, 4, 10
    a = rng.normal(size=(num_slots, n_in, rank)).astype(np.float32)
    b = rng.normal(size=(num_slots, rank, n_out)).astype(np.float32)
    a[0], b[0] = 0, 0
    a[2, 3, 1] = np.nan
    b[2, 0, 5] = np.inf
    slots = np.array([0, 1, 2, 3, 1, 2, 0, 0], np.int32)  # the last two: padding rows
    x = rng.normal(size=(len(slots), n_in)).astype(np.float32)
    got = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), slots))
    clean = slots != 2
    assert np.isfinite(got[clean]).all()
    ref = _delta_reference(x, a, b, np.where(clean, slots, 0))
    np.testing.assert_allclose(got[clean], ref[clean], rtol=1e-5, atol=1e-5)
    assert not np.isfinite(got[~clean]).all(axis=1).any()
    assert not got[slots == 0].any()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama, two PEFT adapters, and broken copies of the first: a NaN in one lora_A,
    and a lora_B of 3e38 that overflows float32 once scaled by lora_alpha / r = 2."""
    root = tmp_path_factory.mktemp("lora_isolation")
    base, models, loras = build("llama_gqa", root, num_adapters=2)
    nan = _broken_copy(Path(loras[0].lora_path), root / "nan", "lora_A", np.nan)
    inf = _broken_copy(Path(loras[0].lora_path), root / "inf", "lora_B", 3e38)
    return base, models, loras, nan, inf


def _broken_copy(src: Path, dst: Path, which: str, value: float) -> tuple[Path, str]:
    """A copy of the adapter at ``src`` whose first ``which`` tensor holds ``value`` in one
    entry (every entry for an overflow); returns (its directory, the tensor's key)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / WEIGHTS))
    key = sorted(k for k in tensors if f".{which}." in k)[0]
    if np.isnan(value):
        tensors[key][0, 0] = value
    else:
        tensors[key][:] = value
    save_file(tensors, str(dst / WEIGHTS))
    return dst, key


def test_non_finite_adapters_are_refused_at_load_naming_the_tensor(tiny):
    base, _, loras, (nan_dir, nan_key), (inf_dir, inf_key) = tiny
    config = load_model(base, "float32", use_cache=False).config
    with pytest.raises(ValueError, match=f"{nan_key}.*not finite"):
        load_adapter(str(nan_dir), config, 16)
    with pytest.raises(ValueError, match=f"{inf_key}.*not finite after scaling"):
        load_adapter(str(inf_dir), config, 16)
    # Finite in float32, not in the slots' float16: refused before the slot is written.
    adapter = load_adapter(loras[0].lora_path, config, 16)
    wa, wb = adapter.weights["q_proj"]
    big = model_lora.LoRAAdapter(
        "big", adapter.rank, adapter.scaling, {"q_proj": (wa, wb * 1e5)}, adapter.head_dim
    )
    slots16 = init_slots(config, 1, 16, jnp.float16)
    with pytest.raises(ValueError, match="'big': q_proj lora_B x scaling 2 is not finite.*float16"):
        check_adapter_fits(slots16, big)
    check_adapter_fits(init_slots(config, 1, 16, jnp.float32), big)


def test_a_nan_and_an_inf_adapter_in_slots_leave_every_other_request_alone(tiny, monkeypatch):
    """Offline, the NaN and the overflowing adapter are refused naming the tensor. With the
    load checks bypassed, a NaN adapter and an overflowing one sit in two of the
    four slots while the base model and two good adapters run in the same batches, before and
    after the bad adapters' own requests finish: the others' tokens equal transformers + PEFT."""
    base, models, loras, (nan_dir, nan_key), (inf_dir, inf_key) = tiny
    llm = LLM(base, block_size=8, max_model_len=64, enable_lora=True, max_loras=4, max_lora_rank=16)
    nan, inf = LoRARequest("nan", 3, str(nan_dir)), LoRARequest("inf", 4, str(inf_dir))
    # Offline, with the checks: refused before anything is queued, the engine untouched.
    with pytest.raises(ValueError, match=f"{nan_dir}.*{nan_key}"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=nan, use_tqdm=False)
    with pytest.raises(ValueError, match=inf_key):
        llm.add_lora(inf)
    assert llm.list_loras() == set() and not llm.engine.has_unfinished_requests()
    monkeypatch.setattr(model_lora, "_check_finite", lambda *args: None)
    for module in (worker_lora, lora_slots):
        monkeypatch.setattr(module, "check_adapter_fits", lambda *args: None)
    rng = np.random.default_rng(3)
    batch = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(4, 20, 8)]
    adapters = [None, loras[0], loras[1], nan, None, inf, loras[1], loras[0]]
    slots = [0, 1, 2, None, 0, None, 2, 1]  # the oracle's model per prompt (None: a bad one)
    outs = llm.generate(batch, GREEDY, lora_request=adapters, use_tqdm=False)
    good = [i for i, s in enumerate(slots) if s is not None]
    want = {i: hf_greedy(models[slots[i]], [batch[i]], MAX_TOKENS)[0] for i in good}
    assert {i: outs[i].outputs[0].token_ids for i in good} == want
    # The bad adapters still hold their slots; later requests of the others are untouched.
    assert llm.engine.lora.manager.slot_of(3) and llm.engine.lora.manager.slot_of(4)
    later = llm.generate([batch[i] for i in good], GREEDY, lora_request=[adapters[i] for i in good])
    assert [o.outputs[0].token_ids for o in later] == [want[i] for i in good]
