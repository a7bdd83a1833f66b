"""`kvgate tune` end to end on the CPU: a tiny model, a budget that leaves room for the
first candidate only, goals loose enough to meet; the config it writes starts `kvgate
serve`, and benchmarked again it meets the goals. With goals no CPU meets, the closest
candidate's config is written all the same, saying what it misses, and serves. Then the
goal watch that stops a candidate early, on real request records, and a candidate's
share of the budget: requests stop starting, those in flight finish."""

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from bench.cli import main as bench
from bench.client import RequestOutput
from bench.datasets import SampleRequest
from bench.history import load_records
from bench.serve import ServeConfig, arrival_times, serve_benchmark
from bench.tiny_model import build_tiny_llama
from bench.tune import MIN_SHARE_S, coarse_grid, parse_duration, search
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


def test_goals_it_cannot_meet_still_leave_a_config_that_serves(tmp_path):
    """The docs' two lines on a CPU: `kvgate tune` with a GPU's goals, then `kvgate serve
    --config` on what it wrote."""
    model = build_tiny_llama(tmp_path / "tiny", hidden_size=64, num_layers=2)
    out = tmp_path / "tune"
    argv = ["tune", "--model", str(model), "--device", "cpu", "--max-model-len", "256"]
    argv += ["--slo-ttft-p99", "0.000001", "--slo-tpot-p99", "0.000001", "--budget", "1s"]
    argv += ["--output", str(out), *WORKLOAD, "--results-dir", str(tmp_path / "history")]
    tune = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tune.returncode == 1, tune.stdout + tune.stderr  # the goals were missed
    # the first candidate's start-up was shown, not waited on in silence
    assert "  starting: started in " in tune.stdout
    summary = json.loads((out / "tune.json").read_text())
    (row,) = summary["candidates"]
    assert row["chosen"] and not row["meets_goals"] and summary["chosen"] == row["candidate"]
    assert "(closest, written)" in (out / "report.md").read_text()
    toml = (out / "kvgate.toml").read_text()
    header = [line for line in toml.splitlines() if line.startswith("#")]
    assert "NO candidate met p99 TTFT <= 1e-06 s and p99 TPOT <= 1e-06 s" in header[0]
    assert f"This is the closest ({row['candidate']}, " in header[1]
    ttft = f"p99 TTFT {row['p99_ttft_s']:.3f} s, over its goal of 1e-06 s by "
    assert any(line.startswith(f"#   {ttft}") for line in header), header
    assert summary["chosen_misses"][0].startswith(ttft)
    printed = tune.stdout[tune.stdout.index("no candidate met the goals") :]
    assert f"wrote the closest, {row['candidate']}, to {out / 'kvgate.toml'}" in printed
    assert ttft in printed
    # and the next line of the docs works
    gw = start_gateway(tmp_path, config=toml, timeout=180)
    try:
        key = gw.tenant_key("check")[1]
        check = ["serve", "--url", gw.url, "--api-key", key, *WORKLOAD, "--no-progress"]
        assert bench([*check, "--no-history"]) == 0
    finally:
        gw.stop()


def test_a_share_of_the_budget_stops_requests_starting_then_cuts_them(tmp_path):
    """Requests due after the share are not sent, those sent finish whole; past the
    share's grace, those still in flight are cut and counted."""
    config = """
[[backends]]
name = "slow"
type = "fake"
served_model_name = "slow-model"
[backends.options]
tokens_per_second = 20
"""
    gw = start_gateway(tmp_path, config=config)
    try:
        key = gw.tenant_key("share")[1]
        requests = [SampleRequest("a prompt", 20, 2) for _ in range(12)]
        cfg = ServeConfig(
            gw.url, None, [key], request_rate=4.0, ignore_eos=True, show_progress=False
        )
        share = 1.0
        result, _ = serve_benchmark(replace(cfg, send_for_s=share), requests)
        # at its end, requests still in flight (a second each, all sent at once) are cut
        at_once = replace(cfg, request_rate=math.inf, abort_after_s=0.5)
        cut, _ = serve_benchmark(at_once, requests[:4])
    finally:
        gw.stop()
    due = sum(offset < share for offset in arrival_times(12, 4.0, 1.0, 0))
    sent = len(result["ttfts"])
    assert 1 <= sent <= due < 12
    assert result["completed"] == sent and result["failed"] == 0
    assert result["output_lens"] == [20] * sent  # in flight at the end, and finished
    assert result["cut_in_flight"] == 0
    assert cut["cut_in_flight"] == 4 and cut["completed"] == 0


class StagesOnly:
    """What search() asks of a tuner, recorded: the share set before the first stage."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s, self.share_s, self.stages = budget_s, math.inf, []

    def run_stage(self, stage, candidates) -> None:
        self.stages.append((stage, len(candidates), self.share_s))

    def best(self) -> None:
        return None

    def repeat_close_calls(self) -> None:
        pass


def test_the_first_candidate_gets_a_share_of_the_budget_not_all_of_it():
    tuner = StagesOnly(budget_s=20 * 60)
    search(tuner, 256)
    (defaults, coarse) = tuner.stages
    assert defaults == ("defaults", 1, 20 * 60 / (1 + coarse[1]))
    assert coarse[2] == defaults[2] < tuner.budget_s
    short = StagesOnly(budget_s=60)
    search(short, 256)
    assert short.stages[0][2] == MIN_SHARE_S
