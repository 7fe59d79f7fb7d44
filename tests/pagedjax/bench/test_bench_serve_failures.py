"""`pagedjax bench serve` fails (exit 1) when a server fails more of its timed requests than
--max-failure-rate allows (default 0: any failure), naming the server and the rate."""

from __future__ import annotations

import json

import pytest
from test_bench_serve import StubServer, stub_script, tiny_dir  # noqa: F401 (fixtures)

from pagedjax.cli import main


def bench(stub, tiny_dir, *flags: str) -> int:  # noqa: F811 (the fixture's value)
    argv = ["bench", "serve", "--base-url", stub.base, "--tokenizer", tiny_dir, "--json"]
    argv += ["--num-warmups", "0", "--dataset-name", "random", "--random-input-len", "4"]
    argv += ["--random-output-len", "3", "--num-prompts", "6", "--max-concurrency", "1"]
    return main([*argv, "--disable-tqdm", *flags])


def test_failed_requests_make_the_command_fail(stub_script, tiny_dir, capsys):  # noqa: F811
    with StubServer(stub_script, "--mode", "errors") as stub:  # 4 of 6 timed requests fail
        assert bench(stub, tiny_dir) == 1
        captured = capsys.readouterr()
        server = json.loads(captured.out)["servers"][0]
        assert (server["requests_sent"], server["requests_failed"]) == (6, 4)
        assert "server: 4 of 6 requests failed (66.7%), over --max-failure-rate 0.0" in captured.err
        assert bench(stub, tiny_dir, "--max-failure-rate", "0.5") == 1
        assert "over --max-failure-rate 0.5" in capsys.readouterr().err
        assert bench(stub, tiny_dir, "--max-failure-rate", "0.7") == 0
        assert "over --max-failure-rate" not in capsys.readouterr().err


def test_a_clean_run_passes_and_a_bad_rate_is_a_usage_error(stub_script, tiny_dir, capsys):  # noqa: F811
    with StubServer(stub_script, "--usage") as stub:
        assert bench(stub, tiny_dir) == 0
        assert json.loads(capsys.readouterr().out)["servers"][0]["requests_failed"] == 0
        for rate in ("-0.1", "1.5", "nan"):
            assert bench(stub, tiny_dir, "--max-failure-rate", rate) == 2
            assert "--max-failure-rate must be in [0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sent,failed,rate,over",
    [(10, 0, 0.0, False), (10, 1, 0.0, True), (10, 1, 0.1, False), (0, 0, 0.0, False)],
)
def test_too_many_failures_counts_every_server(sent, failed, rate, over, capsys):
    from pagedjax.bench.serve import too_many_failures

    servers = [
        {"server": "a", "requests_sent": 4, "requests_failed": 0},
        {"server": "b", "requests_sent": sent, "requests_failed": failed},
    ]
    assert too_many_failures(servers, rate) is over
    assert ("b: " in capsys.readouterr().err) is over
