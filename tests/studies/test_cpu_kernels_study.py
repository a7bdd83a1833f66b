"""studies/cpu_kernels.py runs, times every form at each row count and the attention's
two paths, and the kernel's products equal MKL's (the figures belong in docs/PERF.md)."""

from __future__ import annotations

import json
import shutil

import pytest

from studies import cpu_kernels


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no cc")
def test_the_study_times_every_form(tmp_path):
    result = cpu_kernels.main(["--out", str(tmp_path), "--rounds", "1", "--rows", "1", "4"])
    assert json.loads((tmp_path / "cpu_kernels.json").read_text()) == result
    assert [row["rows_an_expert"] for row in result["experts"]] == [1, 4]
    for row in result["experts"]:
        assert row["max_difference"] < 1e-4
        forms = {"kernel", "kernel, MXFP4", "MKL", "oneDNN", "sum of the weights' bytes"}
        assert forms <= set(row) and all(row[f]["least_ms"] > 0 for f in forms)
    assert set(result["attention"]) == {"kernel", "torch"}
