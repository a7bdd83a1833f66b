"""studies/kv_tiers_copy on the CPU: the host tier's copies against a plain copy of
the same bytes, on a tiny KV shape (the GPU runs Llama 3 8B's, studies/gpu_check.sh)."""

from __future__ import annotations

import json
from pathlib import Path

from backend_gpu.kv_tiers.host import HostRows
from studies import kv_tiers_copy

ROOT = Path(__file__).resolve().parents[2]


def test_the_copy_study_runs_on_a_tiny_shape(tmp_path):
    argv = ["--out", str(tmp_path), "--shape", "tiny", "--device", "cpu", "--blocks", "12"]
    result = kv_tiers_copy.main([*argv, "--repeats", "2"])
    assert json.loads((tmp_path / "kv_tiers_copy.json").read_text()) == json.loads(
        json.dumps(result)
    )
    assert result["round_trip_exact"] is True
    # the tiny llama's block: 2 layers x (K, V) x 16 rows x 2 heads x 16 dims x 4 bytes
    assert result["bytes_per_block"] == 2 * 2 * 16 * 2 * 16 * 4
    assert result["bytes"] == 12 * result["bytes_per_block"]
    for name in ("host_rows_down", "host_rows_up", "plain_down", "plain_up"):
        r = result[name]
        assert r["blocks_per_s"] == 12 / r["seconds"] > 0
        assert r["gb_per_s"] == result["bytes"] / r["seconds"] / 1e9
    down = result["host_rows_down"]["gb_per_s"] / result["plain_down"]["gb_per_s"]
    assert result["share_down"] == down
    assert result["goal_met"] == (min(result["share_down"], result["share_up"]) >= 0.7)


def test_the_round_trip_check_sees_a_block_put_back_in_the_wrong_place():
    layers = kv_tiers_copy.kv_layers("tiny", 4, 16, "cpu")
    rows = HostRows(layers, 16, 4)
    assert kv_tiers_copy.round_trip_exact(rows, layers, "cpu")
    rows.copy_up = lambda row, block: HostRows.copy_up(rows, (row + 1) % 4, block)
    assert not kv_tiers_copy.round_trip_exact(rows, layers, "cpu")


def test_the_gpu_check_runs_the_copy_study():
    script = (ROOT / "studies/gpu_check.sh").read_text()
    assert '-m studies.kv_tiers_copy --out "$out"' in script


def test_the_copy_study_measures_the_stores_under_the_rows(tmp_path):
    url = "redis://127.0.0.1:6379/12"  # a database of this test's own
    argv = ["--out", str(tmp_path), "--shape", "tiny", "--stores", "--store-blocks", "6"]
    result = kv_tiers_copy.main([*argv, "--repeats", "2", "--shared-url", url])
    assert json.loads((tmp_path / "kv_tiers_stores.json").read_text()) == json.loads(
        json.dumps(result)
    )
    assert result["bytes_per_block"] == 2 * 2 * 16 * 2 * 16 * 4
    for name in ("disk_put", "disk_get", "shared_put", "shared_get"):
        r = result[name]
        assert r["blocks_per_s"] == 6 / r["seconds"] > 0
        assert r["gb_per_s"] == result["bytes"] / r["seconds"] / 1e9
    assert "host_rows_down" not in result
