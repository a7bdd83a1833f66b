"""Command-line parsing for `kvgate bench`: SLOs, percentiles, keys, bad input."""

import pytest

from bench.cli import build_parser, main
from bench.options import parse_goodput, parse_metric_names, parse_percentiles, read_api_keys
from bench.sweep import parse_levels
from studies.ports import free_port


def test_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_percentiles_and_metrics():
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("101")
    assert parse_metric_names("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError, match="unknown"):
        parse_metric_names("ttft,latency")


def test_api_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("KVGATE_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    assert read_api_keys(None, None) == ["sk-env"]
    monkeypatch.setenv("KVGATE_API_KEY", "kvg-env")  # kvgate's own first, as `kvgate chat`
    assert read_api_keys(None, None) == ["kvg-env"]
    assert read_api_keys("a, b,c", None) == ["a", "b", "c"]
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenants\nk1\n\nk2\n")
    assert read_api_keys("ignored", str(keys)) == ["k1", "k2"]


def test_parser_defaults():
    args = build_parser().parse_args(["serve", "--dataset", "shared-prefix"])
    assert args.request_rate == float("inf") and args.burstiness == 1.0
    assert args.endpoint == "completions" and args.max_concurrency is None


def test_bad_input_is_a_clear_error(capsys):
    assert main(["serve", "--num-prompts", "0"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert main(["serve", "--goodput", "ttft"]) == 2
    assert "--goodput" in capsys.readouterr().err
    port = free_port()  # a port nothing listens on
    # every request fails to connect: reported per request, not a traceback
    args = ["serve", "--url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--no-progress"]
    assert main([*args, "--model", "m"]) == 1
    assert main(args) == 2  # without --model, asking the server for its models fails
    assert "kvgate bench serve: error" in capsys.readouterr().err


def test_sweep_levels():
    assert parse_levels("1, 4,16") == [1, 4, 16]
    for bad in ("", "0,2", "-1"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_levels(bad)
    assert main(["sweep", "--concurrency", "0"]) == 2
