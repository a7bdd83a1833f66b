"""studies.spec_matmul_rows on small shapes: every form, part and row count is timed,
and the figures it writes are the ones it returns (the times are the study's business)."""

from __future__ import annotations

import json

from studies import spec_matmul_rows


def test_every_form_part_and_row_count_is_timed(tmp_path):
    out = tmp_path / "rows.json"
    argv = ["--layers", "2", "--vocab", "256", "--repeats", "1", "--rows", "1", "3", "--bf16"]
    result = spec_matmul_rows.main([*argv, "--flush-mb", "1", "--save-result", str(out)])
    cases = result["cpu_ms"]
    # parts (layers, LM head) x forms (each of the engine's, and the one it chose) x dtypes
    assert len(cases) == 2 * len(spec_matmul_rows.FORMS) * 2
    assert {name.split(": ")[1].rsplit(" ", 1)[0] for name in cases} == set(spec_matmul_rows.FORMS)
    assert all(set(by_rows) == {1, 3} and min(by_rows.values()) >= 0 for by_rows in cases.values())
    saved = json.loads(out.read_text())["cpu_ms"]
    assert saved.keys() == cases.keys()
