"""`kvgate bench serve` and `sweep` against a real `kvgate serve --backend fake` process,
with two tenants whose keys are made through the admin API."""

import json

import pytest

from bench.cli import main
from bench.metrics import METRIC_NAMES
from tests.conftest import start_gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """One real `kvgate serve --backend fake`, two tenants with a key each."""
    gw = start_gateway(tmp_path_factory.mktemp("gateway"), "--backend", "fake")
    try:
        yield gw.url, [gw.tenant_key(name)[1] for name in ("bench-a", "bench-b")]
    finally:
        gw.stop()


def test_serve_writes_complete_result(gateway, tmp_path, capsys):
    url, keys = gateway
    out = tmp_path / "serve.json"
    argv = ["serve", "--url", url, "--api-key", ",".join(keys), "--num-tenants", "2"]
    argv += ["--dataset", "shared-prefix", "--shared-prefix-len", "32"]
    argv += ["--input-len", "8", "--output-len", "6", "--num-prompts", "12"]
    argv += ["--request-rate", "200", "--max-concurrency", "4", "--ignore-eos"]
    argv += ["--goodput", "e2el:60000", "--metric-percentiles", "50,99"]
    argv += ["--save-result", str(out), "--save-detailed", "--no-progress"]
    rc = main(argv)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms):" in printed
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["num_prompts"] == 12 and len(result["errors"]) == 12
    assert result["missing_usage"] == 0
    # every token count is the server's usage: the fake backend emits exactly max_tokens
    assert result["output_lens"] == [6] * 12
    assert result["total_output_tokens"] == 72
    assert all(n is not None and n >= 40 for n in result["input_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    for name in METRIC_NAMES:
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{name}_ms" in result
    assert result["mean_ttft_ms"] > 0 and result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert 1 <= result["max_concurrent_requests"] <= 4
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert [t["completed"] for t in result["per_tenant"]] == [6, 6]
    assert result["model"] and result["endpoint"] == "completions"
    assert len(result["itls"]) == 12 and all(len(gaps) == 5 for gaps in result["itls"])


def test_chat_sharegpt_and_bad_key(gateway, tmp_path):
    url, keys = gateway
    out = tmp_path / "chat.json"
    args = [
        "serve",
        "--url",
        url,
        "--endpoint",
        "chat",
        "--dataset",
        "sharegpt",
        "--num-prompts",
        "3",
        "--output-len",
        "5",
        "--ignore-eos",
        "--no-progress",
    ]
    assert main([*args, "--api-key", keys[0], "--save-result", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["total_output_tokens"] == 15
    assert "itls" not in result  # per-request timings only with --save-detailed
    # a wrong key: every request fails with the server's 401, and the run says so
    wrong_key = ["--model", result["model"], "--api-key", "sk-wrong", "--save-result", str(out)]
    assert main([*args, *wrong_key]) == 1
    result = json.loads(out.read_text())
    assert result["completed"] == 0 and result["failed"] == 3
    assert all(e.startswith("HTTP 401") for e in result["errors"])


def test_sweep_writes_png(gateway, tmp_path):
    url, keys = gateway
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    argv = ["sweep", "--url", url, "--api-key", keys[0], "--concurrency", "1,4"]
    argv += ["--num-prompts", "8", "--input-len", "16", "--output-len", "4", "--ignore-eos"]
    argv += ["--url2", url, "--api-key2", keys[1], "--label2", "kvgate (tenant b)"]
    argv += ["--save-result", str(out), "--plot", str(png), "--no-progress"]
    rc = main(argv)
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads(out.read_text())
    assert sweep["levels"] == [1, 4]
    assert set(sweep["series"]) == {"kvgate", "kvgate (tenant b)"}
    for points in sweep["series"].values():
        assert [p["max_concurrency"] for p in points] == [1, 4]
        assert all(p["completed"] == 8 and p["output_throughput"] > 0 for p in points)
