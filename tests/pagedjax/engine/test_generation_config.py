"""Default sampling parameters from the model's generation_config.json (vLLM's
``--generation-config auto``): read, filtered and checked; ``LLM.generate`` without
SamplingParams and a server's requests that leave fields unset use them; "vllm" ignores the file;
overrides set values; bad options are refused before a model loads."""

from __future__ import annotations

import json
import logging

import pytest
from hf_models import make_tiny_model
from server_helpers import live_server, raw

from pagedjax import LLM, SamplingParams, cli
from pagedjax.engine.hosting.engine_loop import EngineLoop
from pagedjax.entrypoints.api_server import build_app
from pagedjax.generation_config import default_sampling_params

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _write(folder, **values) -> None:
    file = folder / "generation_config.json"
    data = json.loads(file.read_text()) if file.exists() else {}
    file.write_text(json.dumps(data | values))


def test_the_files_values_as_sampling_params(tmp_path, caplog):
    _write(tmp_path, **QWEN_LIKE, max_new_tokens=32, do_sample=True, bos_token_id=1)
    with caplog.at_level(logging.INFO, logger="pagedjax.engine"):
        found = default_sampling_params("auto", str(tmp_path), None)
    assert found == QWEN_LIKE | {"max_tokens": 32}
    assert "default sampling parameters" in caplog.text
    assert default_sampling_params("vllm", str(tmp_path), None) == {}
    # another folder's file; overrides by generation_config.json's names, merged
    other = tmp_path / "other"
    other.mkdir()
    _write(other, temperature=0.3)
    assert default_sampling_params(str(other), "/nowhere", {"max_new_tokens": 8}) == {
        "temperature": 0.3,
        "max_tokens": 8,
    }
    assert default_sampling_params("vllm", str(tmp_path), {"top_k": 5}) == {"top_k": 5}
    # transformers' own defaults set nothing (vLLM reads the file's difference from them);
    # a value SamplingParams refuses is left out with a warning
    _write(tmp_path, temperature=1.0, top_p=1.0, top_k=50, repetition_penalty=1.0, min_p="x")
    with caplog.at_level(logging.WARNING, logger="pagedjax.engine"):
        assert default_sampling_params("auto", str(tmp_path), None) == {"max_tokens": 32}
    assert "min_p" in caplog.text
    assert default_sampling_params("auto", str(tmp_path / "missing"), None) == {}


@pytest.mark.parametrize(
    "source, overrides, match",
    [
        ("auto", {"do_sample": True}, "override_generation_config: 'do_sample'"),
        ("auto", {"temperature": -1}, "temperature"),
        ("auto", [0.5], "must be an object"),
        ("/no/such/folder", None, "is not a folder"),
        ("", None, "generation_config must be"),
    ],
)
def test_bad_options_are_refused(source, overrides, match):
    with pytest.raises(ValueError, match=match):
        default_sampling_params(source, "/nowhere", overrides)
    with pytest.raises(ValueError, match=match):  # before any model loads
        LLM("/no/such/model", generation_config=source, override_generation_config=overrides)


def test_cli_flags_are_checked_before_loading(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--override-generation-config", '{"beams": 2}', "--prompt", "x"])
    assert "'beams'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory):
    """A tiny model whose generation config samples greedily, at most 5 tokens."""
    path = tmp_path_factory.mktemp("gen_config_llama")
    make_tiny_model("llama_gqa", path)
    _write(path, temperature=0.0, max_new_tokens=5)
    return LLM(str(path), block_size=8, num_blocks=64, max_model_len=64, seed=0)


def test_llm_generate_without_params_uses_them(greedy_by_default):
    llm = greedy_by_default
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    prompts = [[5, 6, 7, 8], [40, 41]]
    plain = llm.generate(prompts, use_tqdm=False)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in greedy]


def test_a_servers_requests_get_them_for_fields_left_unset(greedy_by_default):
    llm = greedy_by_default
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with live_server(build_app(EngineLoop(llm.engine), "m")) as base:
        body = {"model": "m", "prompt": prompt, "max_tokens": None, "ignore_eos": True}
        body["logprobs"] = 0
        status, out = raw(base, "POST", "/v1/completions", body, key=None)
        assert status == 200, out
        choice = json.loads(out)["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == len(want) == 5  # max_new_tokens: 5
        # greedy (temperature 0.0 from the file): the same ids whatever the seed
        texts = set()
        for seed in (1, 2, 3):
            status, out = raw(base, "POST", "/v1/completions", body | {"seed": seed}, key=None)
            texts.add(json.dumps(json.loads(out)["choices"][0]["logprobs"]["tokens"]))
        assert len(texts) == 1
        # a request's own value wins: sampled, the seeds differ
        hot = body | {"temperature": 1.0, "max_tokens": 8}
        outs = {
            raw(base, "POST", "/v1/completions", hot | {"seed": s}, key=None)[1] for s in (1, 2, 3)
        }
        assert (
            len({json.dumps(json.loads(o)["choices"][0]["logprobs"]["tokens"]) for o in outs}) > 1
        )
