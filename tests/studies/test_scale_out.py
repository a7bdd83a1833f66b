"""studies.scale_out's gateway-overhead part on real processes (a fake-backend `kvgate
worker` and a `kvgate serve` with a `remote` entry in front of it), and the arithmetic
its goals are judged by."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from studies.scale_out import OverheadLoad, OverheadPlan, run_overhead
from studies.scale_out_procs import Run
from studies.scale_out_report import overhead_summary, percentile, ratios, table_lines


def _run(tokens_per_s: float, ttfts_ms: list[float], tokens: int = 100) -> Run:
    return Run(
        label="x",
        requests=len(ttfts_ms),
        concurrency=1,
        duration_s=tokens / tokens_per_s,
        output_tokens=tokens,
        prompt_tokens=50,
        cached_tokens=10,
        tokens_per_s=tokens_per_s,
        ttft_p50_ms=percentile(ttfts_ms, 50),
        ttft_p99_ms=percentile(ttfts_ms, 99),
        ttfts_ms=ttfts_ms,
        cpu_s={"gateway": 0.2, "worker 0": 1.0, "worker 1": 0.5},
    )


def test_overhead_summary_pairs_rounds_and_takes_medians() -> None:
    direct = [_run(100, [10, 20, 30]), _run(200, [10, 12]), _run(300, [40])]
    gateway = [_run(95, [11, 22, 33]), _run(210, [30, 30]), _run(270, [41])]
    s = overhead_summary(direct, gateway)
    assert s["tokens_per_s_ratios"] == pytest.approx([0.95, 1.05, 0.9])
    assert s["tokens_per_s_ratio"] == pytest.approx(0.95)
    assert s["ttft_p50_diffs_ms"] == pytest.approx([2.0, 19.0, 1.0])
    assert s["ttft_p50_diff_ms"] == pytest.approx(2.0)
    # pooled: tokens over summed durations, percentiles over all requests
    assert s["direct"]["tokens_per_s"] == pytest.approx(300 / (1 + 0.5 + 1 / 3))
    assert s["direct"]["ttft_p50_ms"] == pytest.approx(np.percentile([10, 20, 30, 10, 12, 40], 50))
    assert s["gateway"]["ttft_p99_ms"] == pytest.approx(np.percentile([11, 22, 33, 30, 30, 41], 99))
    assert s["direct"]["hit_rate"] == pytest.approx(30 / 150)
    assert s["direct"]["cpu_ms_per_token"] == pytest.approx(
        {"gateway": 600 / 300, "workers": 4500 / 300}
    )


def test_scaling_ratios_are_against_the_first_configuration() -> None:
    rows = [
        {"id": "a", "tokens_per_s": 50.0},
        {"id": "b", "tokens_per_s": 90.0},
        {"id": "c", "tokens_per_s": 75.0},
    ]
    assert ratios(rows) == pytest.approx({"b_over_a": 1.8, "c_over_a": 1.5})


def test_overhead_on_fake_worker_processes(tmp_path: Path) -> None:
    plan = OverheadPlan(
        backend="fake",
        model_id="fake-model",
        worker_options={},
        loads=[OverheadLoad(concurrency=2, requests=2, output_len=4, rounds=2)],
        input_len=8,
    )
    result = run_overhead(plan, tmp_path)
    assert result["backend"] == "fake"
    [load] = result["loads"]
    assert (load["concurrency"], load["requests"], load["output_len"]) == (2, 2, 4)
    assert [r["order"] for r in load["rounds"]] == [["direct", "gateway"], ["gateway", "direct"]]
    for r in load["rounds"]:
        for arm in ("direct", "gateway"):
            run = r[arm]
            assert (run["requests"], run["output_tokens"]) == (2, 8)  # ignore_eos: all 4 each
            assert run["prompt_tokens"] > 0 and len(run["ttfts_ms"]) == 2
            assert set(run["cpu_s"]) == {"gateway", "worker", "client"}
    direct = [r["direct"] for r in load["rounds"]]
    gateway = [r["gateway"] for r in load["rounds"]]
    expected = [g["tokens_per_s"] / d["tokens_per_s"] for d, g in zip(direct, gateway, strict=True)]
    assert load["tokens_per_s_ratios"] == pytest.approx(expected)
    assert load["tokens_per_s_ratio"] == pytest.approx(statistics.median(expected))
    diffs = [g["ttft_p50_ms"] - d["ttft_p50_ms"] for d, g in zip(direct, gateway, strict=True)]
    assert load["ttft_p50_diff_ms"] == pytest.approx(statistics.median(diffs))
    assert load["direct"]["output_tokens"] == load["gateway"]["output_tokens"] == 16
    text = "\n".join(table_lines({"overhead": result}))
    assert "| 2 |" in text and f"{load['tokens_per_s_ratio']:.3f}x" in text
