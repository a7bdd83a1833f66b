"""The data source and the view records on their own, without a screen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from top_helpers import DATA

from tui import fmt
from tui.cli import main, parse_args
from tui.source import StatsSource, load_replay
from tui.view import TenantRow, budget_left, quota_used, sort_and_filter, tenant_rows


def snap(ts: float, rps: float) -> dict:
    return {"ts": ts, "rates": {"requests_per_s": rps}}


def test_history_keeps_only_the_window():
    source = StatsSource(history_s=10.0)
    for i in range(30):
        source.ingest(snap(1000.0 + i, float(i)))
    assert [p[0] for p in source.history] == [1019.0 + i for i in range(11)]
    board = source.dashboard()
    assert board.throughput[2].values == [float(19 + i) for i in range(11)]
    assert board.throughput[2].current == 29.0


def test_history_starts_over_when_the_clock_goes_back():
    source = StatsSource()
    source.ingest(snap(2000.0, 1.0))
    source.ingest(snap(2001.0, 2.0))
    source.ingest(snap(5.0, 3.0))
    assert list(source.history) == [(5.0, 3.0, 0.0, 0.0)]


def test_a_partial_snapshot_does_not_break_the_view():
    source = StatsSource()
    source.ingest({"tenants": [{"id": "t1"}], "backends": [{"name": "b", "kv_usage": None}]})
    board = source.dashboard()
    assert board.tenants[0].name == "t1" and board.tenants[0].quota_used is None
    assert board.engine.prefix_hit_rate is None
    assert board.latency.ttft_p50_ms is None
    # Wrong types anywhere (a gateway of another version, a hand-edited file): no crash.
    source.ingest(
        {
            "ts": "late",
            "rates": [1],
            "totals": "x",
            "latency": 5,
            "gateway": [],
            "tenants": [{"id": "t2", "quota": "x"}, 7],
            "backends": "y",
            "errors": {"a": 1},
        }
    )
    board = source.dashboard()
    assert [t.id for t in board.tenants] == ["t2"] and board.backends == []
    assert board.throughput[0].current == 0.0
    with pytest.raises(ValueError, match="JSON object"):
        source.ingest([1, 2])  # type: ignore[arg-type]


async def test_replay_plays_every_snapshot_then_finishes():
    snapshots = load_replay(DATA)
    source = StatsSource(replay=snapshots, speed=0)
    await source.run()
    assert source.received == len(snapshots)
    assert source.snapshot == snapshots[-1]
    assert source.connection.state == "replay finished"


def test_quota_used_is_the_tightest_limit():
    quota = {
        "rpm": 100,
        "rpm_used": 50,
        "tpm": None,
        "tpm_used": 10**6,
        "daily_tokens": 1000,
        "daily_used": 900,
        "monthly_tokens": None,
        "monthly_used": 5,
    }
    assert quota_used(quota) == pytest.approx(0.9)
    assert budget_left(quota) == 100
    unlimited = {"rpm": None, "rpm_used": 7, "daily_tokens": None, "monthly_tokens": None}
    assert quota_used(unlimited) is None and budget_left(unlimited) is None
    assert budget_left({"daily_tokens": 10, "daily_used": 25}) == 0
    # Money budgets count as limits too; budget_left stays in tokens.
    money = quota | {"monthly_spend": 2.0, "monthly_spend_used": 1.9, "daily_spend": None}
    assert quota_used(money) == pytest.approx(0.95)
    assert budget_left(money) == 100
    assert quota_used({"daily_spend": 0.5, "daily_spend_used": 0.1}) == pytest.approx(0.2)


def test_spend_today_comes_from_the_quota_and_reads_in_dollars():
    (row,) = tenant_rows([{"id": "t", "quota": {"daily_spend_used": 0.4213}}])
    assert row.spend_today == pytest.approx(0.4213)
    assert tenant_rows([{"id": "t", "quota": {"daily_used": 5}}])[0].spend_today is None
    assert [fmt.usd(v) for v in (None, 0.0, 0.004, 0.4213, 12.5, 1234.5)] == [
        "-",
        "$0.00",
        "<$0.01",
        "$0.42",
        "$12.50",
        "$1.2k",
    ]


def test_sort_puts_unlimited_quotas_last_and_filter_matches_ids():
    rows = [
        TenantRow("t_1", "bee", 1.0, 5.0, 0, 0, None, None),
        TenantRow("t_2", "Ant", 2.0, 5.0, 3, 0, 0.5, 10),
        TenantRow("t_3", "cat", 0.5, 9.0, 1, 0, 0.0, 10, spend_today=0.01),
    ]
    assert [r.name for r in sort_and_filter(rows, "quota_used", "")] == ["Ant", "cat", "bee"]
    assert [r.name for r in sort_and_filter(rows, "spend_today", "")] == ["cat", "Ant", "bee"]
    assert [r.name for r in sort_and_filter(rows, "tokens_per_s", "")] == ["cat", "Ant", "bee"]
    assert [r.name for r in sort_and_filter(rows, "name", "")] == ["Ant", "bee", "cat"]
    assert [r.name for r in sort_and_filter(rows, "rejected_429", "T_3")] == ["cat"]


def test_cli_defaults_and_admin_key_from_env(monkeypatch):
    monkeypatch.setenv("KVGATE_ADMIN_KEY", "from-env")
    args = parse_args([])
    assert args.url == "http://127.0.0.1:8000" and args.admin_key == "from-env"
    assert args.interval == 1.0 and args.replay is None
    assert parse_args(["--admin-key", "k", "--interval", "0.5"]).admin_key == "k"
    with pytest.raises(SystemExit):
        parse_args(["--interval", "0"])


def test_cli_rejects_a_broken_replay_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ts": 1.0}) + "\n{not json\n")
    assert main(["--replay", str(bad)]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
    assert main(["--replay", str(tmp_path / "missing.jsonl")]) == 2


def test_python_dash_m_tui_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tui", "--help"], capture_output=True, text=True, check=True
    )
    assert "--replay" in out.stdout and "--admin-key" in out.stdout


def test_cli_screenshot_plays_the_replay_and_saves_an_svg(tmp_path):
    out = tmp_path / "top.svg"
    assert main(["--replay", str(DATA), "--screenshot", str(out), "--size", "120x40"]) == 0
    svg = out.read_text()
    last = load_replay(DATA)[-1]
    assert svg.startswith("<svg") and "replay&#160;finished" in svg
    for tenant in last["tenants"]:
        assert tenant["name"] in svg
    with pytest.raises(SystemExit):
        parse_args(["--screenshot", str(out)])  # needs --replay
