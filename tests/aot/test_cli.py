"""``pagedjax compile``: a small Llama's programs compiled for a v5e from its config alone (no
weights), reported as a table and as JSON; exit 1 when a program would not do (here: a pool
bigger than the chip), 2 on bad input, named. (The pool is of a real size, 256 MiB: XLA:TPU
moves a pool of a few MiB into VMEM and back, which the report counts as copies.)"""

from __future__ import annotations

import json

import pytest
from aot_cases import target_or_skip

from pagedjax.cli import main

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--dtype", "bfloat16"]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_compile_reports_each_program(config, tmp_path, capsys):
    target_or_skip("v5e-1")
    out = tmp_path / "report.json"
    argv = ["compile", "--target", "v5e-1", "--model", config, "--num-blocks", "8192", *ENGINE]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "v5e-1 (TPU v5 lite x 1" in text and "attention tpu" in text
    report = json.loads(out.read_text())
    assert report["num_blocks"] == 8192 and report["pool_bytes"] == 2 * 2 * 2 * 8192 * 4096
    names = [p["name"] for p in report["programs"]]
    assert [n.split()[1] for n in names] == ["decode", "prefill"]
    for program in report["programs"]:
        assert program["error"] is None
        assert program["findings"]["pool_copies"] == 0
        assert program["peak_bytes"] < report["device_bytes"]


def test_a_pool_bigger_than_the_chip_fails(config, capsys):
    target_or_skip("v5e-1")
    argv = ["compile", "--target", "v5e-1", "--model", config, *ENGINE, "--only", "decode"]
    assert main([*argv, "--num-blocks", "2000000"]) == 1  # 2 layers x K, V x 2 heads x 2M x 4 KiB
    out = capsys.readouterr().out
    assert "needs" in out or "Ran out of memory" in out, out


def test_bad_input_is_named(config, capsys):
    assert main(["compile", "--target", "v5e-1", "--model", "/no/such/model"]) == 2
    assert "/no/such/model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", "--target", "v9z-1", "--model", config])


def test_a_missing_compiler_is_named(config, monkeypatch, capsys):
    """Without libtpu (or the CUDA plugin) a target refuses with the package to install."""
    from pagedjax.aot import targets

    monkeypatch.setattr(targets.Target, "available", lambda self: False)
    assert main(["compile", "--target", "v5e-8", "--model", config]) == 2
    assert "needs libtpu (pip install 'pagedjax[tpu]')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jax_cuda12_plugin"):
        targets.get_target("h100").devices()
