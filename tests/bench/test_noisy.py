"""`kvgate bench noisy`: the share arithmetic on made-up streams (ratio against the
weights, the largest gap of weighted service, Jain's index, the window's edges), and the
whole mode against a real `kvgate serve --backend fake` process with three tenants."""

import json

import pytest

from bench.cli import main
from bench.metrics import percentile
from bench.noisy import Stream, share_summary
from tests.conftest import start_gateway


def stream(tenant: str, times: list[float]) -> Stream:
    return Stream(tenant, 0.0, list(times))


def test_equal_service_is_fair_and_gapless_to_one_token():
    a = [stream("A", [0.1, 0.3, 0.5, 0.7])]
    b = [stream("B", [0.2, 0.4, 0.6, 0.8])]
    s = share_summary(a, b, (1.0, 1.0), 0.0, 1.0)
    assert s["tokens"] == {"A": 4, "B": 4}
    assert s["share_vs_weights"] == 1.0 and s["jain"] == 1.0
    assert s["largest_gap_tokens"] == 1.0  # A is one token ahead after each of its tokens
    assert s["output_tokens_per_s"] == 8.0


def test_weights_divide_the_share_and_a_burst_is_the_gap():
    a = [stream("A", [0.1 * i for i in range(1, 9)])]  # 8 tokens first
    b = [stream("B", [0.9, 0.95, 0.97, 0.99])]  # then 4
    s = share_summary(a, b, (2.0, 1.0), 0.0, 1.0)
    assert s["share_vs_weights"] == 1.0  # 8 / 2 == 4 / 1
    assert s["largest_gap_tokens"] == 4.0  # A's 8 tokens, halved, before any of B's
    unweighted = share_summary(a, b, (1.0, 1.0), 0.0, 1.0)
    assert unweighted["share_vs_weights"] == 2.0
    assert unweighted["jain"] == pytest.approx(144 / 160)


def test_only_the_window_counts():
    a = [stream("A", [0.5, 1.5, 2.5])]
    b = [stream("B", [0.6, 1.6, 3.5])]
    s = share_summary(a, b, (1.0, 1.0), 1.0, 3.0)
    assert s["tokens"] == {"A": 2, "B": 1} and s["seconds"] == 2.0


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 99) == 99


def test_noisy_mode_against_a_live_gateway(tmp_path, capsys):
    gw = start_gateway(tmp_path, "--backend", "fake")
    try:
        keys = [
            gw.tenant_key(n, weight=w)[1] for n, w in (("flood", 1), ("steady", 1), ("heavy", 2))
        ]
        out, history = tmp_path / "noisy.json", tmp_path / "history"
        rc = main(
            [
                "noisy",
                "--url",
                gw.url,
                "--model",
                "fake-model",
                "--key-a",
                keys[0],
                "--key-b",
                keys[1],
            ]
            + [f"--key-heavy={keys[2]}", "--flood", "4", "--b-requests", "3"]
            + ["--b-interval", "0.05", "--backlog", "2", "--backlog-s", "0.5"]
            + ["--warmup-s", "0.2", "--save-result", str(out), "--results-dir", str(history)]
        )
    finally:
        gw.stop()
    assert rc == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["alone"]["B"]["requests"] == report["flood"]["B"]["requests"] == 3
    assert report["flood"]["tokens"]["B"] == 3 * 16  # the fake emits max_tokens each
    for phase in ("backlog", "backlog_weighted"):
        assert report[phase]["tokens"]["A"] > 0 and report[phase]["tokens"]["B"] > 0
        assert 0.5 <= report[phase]["jain"] <= 1.0
    assert report["backlog_weighted"]["weights"] == [2.0, 1.0]
    assert "key_a" not in report["args"] and report["args"]["flood"] == 4
    (record,) = history.iterdir()  # the run's history record: none of the keys
    assert not any(key in record.read_text() for key in keys)
    assert json.loads(record.read_text())["config"]["key_heavy"] == "<redacted>"
