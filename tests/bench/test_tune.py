"""`kvgate tune` end to end on the CPU: a tiny model, a budget that leaves room for the
first candidate only, goals loose enough to meet; the config it writes starts `kvgate
serve`, and benchmarked again it meets the goals. Then the goal watch that stops a
candidate early, on real request records."""

import json

import pytest

from bench.cli import main as bench
from bench.client import RequestOutput
from bench.history import load_records
from bench.tiny_model import build_tiny_llama
from bench.tune import coarse_grid, parse_duration
from bench.tune_run import Goals, GoalWatch
from gateway.cli.main import main as kvgate
from tests.conftest import start_gateway

WORKLOAD = ["--num-prompts", "6", "--input-len", "8", "--output-len", "6", "--ignore-eos"]
TTFT_S, TPOT_S = 60.0, 10.0


def test_tune_writes_a_config_that_serves_within_the_goals(tmp_path, capsys):
    model = build_tiny_llama(tmp_path / "tiny", hidden_size=64, num_layers=2)
    out, history = tmp_path / "tune", tmp_path / "history"
    argv = ["tune", "--backend", "gpu", "--model", str(model), "--device", "cpu"]
    argv += ["--max-model-len", "256", "--slo-ttft-p99", str(TTFT_S)]
    argv += ["--slo-tpot-p99", str(TPOT_S), "--budget", "1s", "--output", str(out)]
    argv += [*WORKLOAD, "--results-dir", str(history), "--no-progress"]
    assert kvgate(argv) == 0
    printed = capsys.readouterr().out
    assert "[defaults 1/1]" in printed and "budget spent" in printed
    summary = json.loads((out / "tune.json").read_text())
    (row,) = summary["candidates"]
    assert row["stage"] == "defaults" and row["meets_goals"] and row["chosen"]
    assert row["p99_ttft_s"] <= TTFT_S and row["p99_tpot_s"] <= TPOT_S
    assert row["candidate"] in (out / "report.md").read_text()
    assert (out / "tune.png").stat().st_size > 0
    (record,) = load_records(history)  # the candidate's history record
    assert record["kind"] == "tune" and record["config"]["candidate"] == row["candidate"]
    assert record["figures"]["completed"] == 6 and record["figures"]["peak_rss_bytes"] > 0
    assert record["config"]["model"] == str(model) and record["config"]["ignore_eos"]
    # another candidate of the same tune is the same workload: compared without a word
    other = record | {"id": record["id"][:-4] + "zzzz"}
    other["config"] = record["config"] | {
        "candidate": "x",
        "max_num_seqs": 4,
        "quantization": "int8",
    }
    pair = tmp_path / "pair"
    pair.mkdir()
    for r in (record, other):
        (pair / f"{r['id']}.json").write_text(json.dumps(r))
    capsys.readouterr()
    assert bench(["compare", record["id"], other["id"], "--results-dir", str(pair)]) == 0
    assert "WARNING" not in capsys.readouterr().out
    # the chosen config serves, and benchmarked again meets the goals it was chosen for
    gw = start_gateway(tmp_path, config=(out / "kvgate.toml").read_text(), timeout=180)
    try:
        key = gw.tenant_key("check")[1]
        result_file = tmp_path / "check.json"
        check = ["serve", "--url", gw.url, "--api-key", key, *WORKLOAD, "--no-progress"]
        check += ["--save-result", str(result_file), "--results-dir", str(history)]
        assert bench(check) == 0
    finally:
        gw.stop()
    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert Goals(TTFT_S, TPOT_S).met_by(result)


def output(ttft: float, tokens: int, latency: float, success: bool = True) -> RequestOutput:
    return RequestOutput(
        success=success,
        ttft=ttft,
        latency=latency,
        output_tokens=tokens,
        error="" if success else "HTTP 500",
    )


def test_goal_watch_stops_once_the_p99_is_lost():
    goals = Goals(ttft_p99_s=1.0, tpot_p99_s=0.1)
    # 100 requests: p99 interpolates between the 99th and 100th value; one slow
    # request can still hide above it, the second cannot
    watch = GoalWatch(goals, 100, "c")
    assert not watch(output(0.2, 10, 1.0))
    assert not watch(output(5.0, 10, 6.0))
    assert watch(output(5.0, 10, 6.0)) and "TTFT" in watch.reason
    watch = GoalWatch(goals, 10, "c")  # of ten, the same: the p99 lies between the last two
    slow = output(0.1, 11, 0.1 + 10 * 0.5)  # 0.5 s per output token
    assert not watch(slow) and watch(slow) and "TPOT" in watch.reason
    watch = GoalWatch(goals, 10, "c")
    assert watch(output(0.0, 0, 0.0, success=False)) and "failed" in watch.reason


def test_budget_and_grid():
    assert parse_duration("20m") == 1200 and parse_duration("1h30m") == 5400
    assert parse_duration("90s") == parse_duration("90") == 90
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")
    # no max_num_seqs beyond what the workload can fill, the defaults' budget first
    grid = coarse_grid(16)
    assert {c.max_num_seqs for c in grid} == {4, 8, 16}
    assert {c.max_num_seqs for c in coarse_grid(2)} == {1, 2}
    assert [c.max_num_batched_tokens for c in grid[:2]] == [2048, 2048]
