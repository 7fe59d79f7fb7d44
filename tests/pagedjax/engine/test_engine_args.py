"""EngineArgs: every engine option declared once, with vLLM's names. Its fields are the CLI's
flags and LLM's keywords; vLLM's options are accepted (those that mean nothing here logged),
and what pagedjax lacks is refused by name, before anything loads."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest
from pagedjax.models import loader
from pagedjax.models.config import ModelConfig
from pagedjax.models.hf_overrides import apply_hf_overrides

from pagedjax import LLM, EngineArgs, cli
from pagedjax.engine import model_loading
from pagedjax.engine.arg_options import log_inert_fields
from pagedjax.utils import FlexibleArgumentParser


def _parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def _parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(_parser().parse_args(argv))


def test_each_field_is_a_flag_and_a_keyword_with_its_default():
    args = _parse([])
    assert args == EngineArgs()  # the flags' defaults are the fields'
    for field in dataclasses.fields(EngineArgs):
        assert field.metadata["help"], field.name
    flags = {o for a in _parser()._actions for o in a.option_strings}
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineArgs)} <= flags
    assert EngineArgs.from_keywords("m", swap_space_gib=2.0).swap_space == 2.0  # older name
    with pytest.raises(ValueError, match="name the same option"):
        EngineArgs.from_keywords("m", swap_space_gib=2.0, swap_space=1.0)
    with pytest.raises(TypeError, match="no_such_option"):
        EngineArgs.from_keywords("m", no_such_option=1)


def test_flags_take_vllm_spellings():
    args = _parse(
        ["-tp", "1", "--max_model_len", "64", "--num-gpu-blocks-override", "40", "-O", "3"]
    )
    assert (args.tensor_parallel_size, args.max_model_len, args.num_blocks) == (1, 64, 40)
    assert args.compilation_config == "3"
    args = _parse(["--no-enable-prefix-caching", "--dtype", "auto", "--hf-overrides", "{}"])
    assert (args.enable_prefix_caching, args.dtype, args.hf_overrides) == (False, "auto", {})


def test_add_cli_args_takes_an_argument_group(tmp_path):
    """vLLM's basic/generate.py adds the engine's flags to a group of its own parser."""
    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    assert EngineArgs.add_cli_args(group) is group
    group.set_defaults(model="some/model")
    config = tmp_path / "engine.yaml"
    config.write_text("max_model_len: 128\nenable_prefix_caching: false\n")
    args = vars(parser.parse_args(["--config", str(config), "--block-size", "8"]))
    assert EngineArgs(**args) == EngineArgs(
        model="some/model", max_model_len=128, enable_prefix_caching=False, block_size=8
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-pp", "2"], "pipeline parallelism is not supported"),
        (["-dp", "2"], "--ray --num-replicas"),
        (["--distributed-executor-backend", "ray"], "JAX drives the devices"),
        (["--limit-mm-per-prompt", '{"image": 1}'], "multimodal inputs are not supported"),
        (["--dtype", "half"], "float32 or bfloat16"),
        (["--max-logprobs", "21"], "max-logprobs"),
        (["--block-size", "7"], "block_size must be one of"),
        (["--load-format", "pt"], "invalid choice"),
        (["--reasoning-parser", "deepseek_r1"], "reasoning_content"),
    ],
)
def test_what_pagedjax_lacks_is_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert message in err and argv[0] in err


def test_keywords_are_checked_before_anything_loads(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(model_loading, "load_model", no_load)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="float16")
    with pytest.raises(ValueError, match="pipeline_parallel_size: pipeline parallelism"):
        LLM(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(limit_mm_per_prompt={"image": 2})
    with pytest.raises(ValueError, match="load_format='gguf' needs a .gguf file"):
        LLM("some/folder", load_format="gguf")
    EngineArgs(limit_mm_per_prompt={"image": 0})  # no images: a text model's own limit


def test_inert_options_are_logged_once_each(caplog):
    args = EngineArgs(enforce_eager=True, trust_remote_code=True, tokenizer_mode="slow")
    with caplog.at_level(logging.INFO, logger="pagedjax"):
        log_inert_fields(args)
        log_inert_fields(EngineArgs())  # defaults: nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert any("enforce_eager=True has no effect in pagedjax" in line for line in lines)
    assert any("trust_remote_code=True" in line and "built in" in line for line in lines)


def test_dtype_auto_is_float32_on_a_cpu():
    assert model_loading.resolved_dtype("auto") == "float32"
    assert model_loading.resolved_dtype("float") == "float32"
    assert model_loading.resolved_dtype("bfloat16") == "bfloat16"
    assert EngineArgs(model="m", dtype="auto", max_model_len=64).create_engine_config().dtype == (
        "float32"
    )


def test_hub_options_reach_the_download(monkeypatch, tmp_path):
    import huggingface_hub

    seen = {}

    def fake_download(repo, **kwargs):
        seen.update(kwargs, repo=repo)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    hub = loader.HubOptions(revision="v1.2", download_dir=str(tmp_path / "dl"), token="hf_x")
    assert loader.resolve("org/model", hub) == tmp_path
    assert seen["repo"] == "org/model" and seen["revision"] == "v1.2"
    assert (seen["cache_dir"], seen["token"]) == (str(tmp_path / "dl"), "hf_x")


def test_hf_overrides_replace_what_leaves_the_weights_alone():
    config = ModelConfig("LlamaForCausalLM", 32, 16, 32, 2, 2, 2, 8, max_position_embeddings=64)
    changed = apply_hf_overrides(
        config, {"max_position_embeddings": 256, "rope_theta": 5e5, "eos_token_id": [3, 4]}
    )
    assert (changed.max_position_embeddings, changed.rope_theta) == (256, 5e5)
    assert changed.eos_token_ids == (3, 4) and changed.hidden_size == config.hidden_size
    with pytest.raises(ValueError, match="'hidden_size' cannot be overridden"):
        apply_hf_overrides(config, {"hidden_size": 32})
    with pytest.raises(ValueError, match="rope_theta"):
        apply_hf_overrides(config, {"rope_theta": "fast"})


def test_every_flag_has_help_and_the_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "pagedjax serve" in top
    for command in ("serve", "generate"):
        parser = FlexibleArgumentParser(prog="pagedjax")
        sub = parser.add_subparsers()
        getattr(cli, f"_add_{command}_parser")(sub)
        (sub_parser,) = sub.choices.values()
        missing = [
            a.option_strings
            for a in sub_parser._actions
            if a.option_strings and not a.help and a.dest != "help"
        ]
        assert not missing, (command, missing)


def test_max_logprobs_bounds_what_a_request_may_ask():
    from pagedjax import SamplingParams
    from pagedjax.engine.input_processor import Capacity, InputProcessor

    cap = Capacity(64, 4, 256, True, 8, 32, 30, 0, vocab_size=100, max_logprobs=2)
    check = InputProcessor(cap).check
    check([5, 6], SamplingParams(logprobs=2, prompt_logprobs=2, max_tokens=4))
    with pytest.raises(ValueError, match="logprobs=3 exceeds max_logprobs=2"):
        check([5, 6], SamplingParams(logprobs=3, max_tokens=4))
    with pytest.raises(ValueError, match="prompt_logprobs=5 exceeds max_logprobs=2"):
        check([5, 6], SamplingParams(prompt_logprobs=5, max_tokens=4))


def test_another_tokenizer_replaces_the_models(tmp_path):
    config = ModelConfig("LlamaForCausalLM", 32, 16, 32, 2, 2, 2, 8)
    loaded = loader.LoadedModel(config, {}, str(tmp_path / "m"), str(tmp_path / "m"))
    (tmp_path / "tok").mkdir()
    (tmp_path / "t.gguf").write_bytes(b"")
    hub = loader.HubOptions()
    swapped = model_loading.with_tokenizer(loaded, str(tmp_path / "tok"), None, hub)
    assert (swapped.tokenizer_dir, swapped.gguf_file) == (str(tmp_path / "tok"), None)
    swapped = model_loading.with_tokenizer(loaded, str(tmp_path / "t.gguf"), None, hub)
    assert (swapped.tokenizer_dir, swapped.gguf_file) == (str(tmp_path), "t.gguf")
    assert swapped.config is config and swapped.source == loaded.source


def test_ray_replicas_keywords_are_engine_args_checked_before_deploying():
    from pagedjax.entrypoints.serve_ray.options import builder_arguments

    model, _, kwargs = builder_arguments({"model": "m", "llm_kwargs": '{"max_num_seqs": 4}'})
    assert (model, kwargs["llm_kwargs"]) == ("m", {"max_num_seqs": 4})
    with pytest.raises(ValueError, match="llm_kwargs: .*no_such_option"):
        builder_arguments({"model": "m", "llm_kwargs": '{"no_such_option": 1}'})
    with pytest.raises(ValueError, match="block_size must be one of"):
        builder_arguments({"model": "m", "llm_kwargs": {"block_size": 7}})
