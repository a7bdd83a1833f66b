"""studies/lora_packed_shrink.py runs and writes both projections' figures (one call per
round here: the figures themselves belong in docs/PERF.md)."""

from __future__ import annotations

import json

from studies import lora_packed_shrink


def test_the_study_times_both_packed_projections(tmp_path):
    results = lora_packed_shrink.main(["--out", str(tmp_path), "--number", "1", "--repeat", "1"])
    assert set(results) == set(lora_packed_shrink.PROJECTIONS)
    assert json.loads((tmp_path / "lora_packed_shrink.json").read_text()) == results
    for figures in results.values():
        assert figures["each_us"] > 0 and figures["at_once_us"] > 0
