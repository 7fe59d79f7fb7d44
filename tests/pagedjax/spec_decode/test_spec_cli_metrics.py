"""Speculation's counts on /metrics, and ``--speculative-config`` on the command line."""

from __future__ import annotations

import json

import pytest
from fake_model import idle_stats

from pagedjax.cli import main
from pagedjax.metrics.server import ServerMetrics
from pagedjax.spec_decode import SpecDecodingStats


def test_metrics_export_speculation_counts():
    spec = SpecDecodingStats()
    spec.observe(4, 3)
    spec.observe(2, 0)
    metrics = ServerMetrics()
    metrics.publish(idle_stats(spec_decoding=spec))
    text = metrics.render().decode()
    for line in [
        "pagedjax_spec_decode_num_drafts_total 2.0",
        "pagedjax_spec_decode_num_draft_tokens_total 6.0",
        "pagedjax_spec_decode_num_accepted_tokens_total 3.0",
        "pagedjax_spec_decode_acceptance_rate 0.5",
        "pagedjax_spec_decode_mean_acceptance_length 2.5",
        'pagedjax_spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0',
        'pagedjax_spec_decode_num_accepted_tokens_per_pos_total{position="3"} 0.0',
    ]:
        assert line in text.splitlines(), line
    # An engine that does not speculate exports none of them.
    metrics.publish(idle_stats(spec_decoding=None))
    assert "spec_decode" not in metrics.render().decode()


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "Expecting property name"),
        ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown keys"),
    ],
)
def test_a_bad_speculative_config_is_refused_before_loading(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--speculative-config", value])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_with_speculation(tmp_path, capsys):
    from hf_models import make_tiny_model, save_word_tokenizer

    make_tiny_model("llama_gqa", tmp_path)
    save_word_tokenizer(tmp_path)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    args = ["generate", "--model", str(tmp_path), "--prompt", "w17 w40 w93 w7 " * 4]
    args += ["--max-tokens", "24", "--block-size", "8", "--max-model-len", "64"]
    args += ["--num-blocks", "13", "--speculative-config", json.dumps(spec)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "output (24 tokens" in out and "speculation: " in out and "proposed tokens" in out
