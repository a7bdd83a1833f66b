"""studies/gpt_oss_short_runs.py runs, times both forms, the engine's and transformers'
expert layer and an MXFP4 widening, and the two layers compute the same outputs (the
figures belong in docs/PERF.md)."""

from __future__ import annotations

import json

from studies import gpt_oss_short_runs


def test_the_study_times_both_forms_the_layers_and_the_widening(tmp_path):
    result = gpt_oss_short_runs.main(["--out", str(tmp_path), "--rounds", "1"])
    assert json.loads((tmp_path / "gpt_oss_short_runs.json").read_text()) == result
    assert len(result["products"]) == 2 * 2 * len(gpt_oss_short_runs.ROWS)
    for row in result["products"]:
        assert all(s > 0 for s in row["seconds"].values())
    layer = result["layer"]
    assert sum(layer["runs"]) == gpt_oss_short_runs.TOKENS * gpt_oss_short_runs.TOP_K
    assert layer["max_difference"] < 1e-4
    assert set(layer["seconds"]) == {"transformers", "kvgate"}
    assert all(s > 0 for s in layer["seconds"].values())
    assert all(s > 0 for s in result["widen"]["seconds"].values())
