"""`kvgate bench ladder` on a small random Llama (built locally, seeded), every step:
the engine's real features are measured, the missing ones are reported, not estimated."""

import json

import pytest

from bench.cli import main

TINY_WORKLOAD = (
    ["--model", "random", "--num-prompts", "4", "--input-len", "12", "--output-len", "6"]
    + ["--prefix-len", "48", "--suffix-len", "4", "--prefix-output-len", "3"]
    + ["--long-num-prompts", "2", "--long-output-len", "12", "--max-num-seqs", "2"]
    + ["--kv-cache-memory-bytes", str(8 << 20), "--max-model-len", "512", "--no-progress"]
)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ladder")
    paths = {k: tmp / f"ladder.{k}" for k in ("json", "png", "md")}
    outputs = ["--save-result", paths["json"], "--plot", paths["png"], "--markdown", paths["md"]]
    rc = main(["ladder", *TINY_WORKLOAD, *map(str, outputs)])
    return rc, json.loads(paths["json"].read_text()), paths


def test_ladder_rows(ladder):
    rc, result, _ = ladder
    assert rc == 0
    rows = {r["step"]: r for r in result["rows"]}
    assert rows["0 static batching"]["available"]
    assert rows["1 continuous batching"]["available"]
    expected_tokens = {
        name: round(w["num_requests"] * w["mean_max_tokens"])
        for name, w in result["workloads"].items()
    }
    for row in result["rows"]:
        if row["available"]:
            # ignore_eos: every request runs to its max_tokens
            assert row["output_tokens"] == expected_tokens[row["workload"]]
            assert row["num_requests"] == result["workloads"][row["workload"]]["num_requests"]
            assert row["output_tok_s"] > 0 and row["mean_ttft_ms"] > 0
            assert row["peak_mib"] >= row["weights_mib"] > 0
            assert row["extra"]["output_tok_s_runs"] == [row["output_tok_s"]]
        else:
            assert row["reason"].split(":")[0] in {"NotImplementedError", "TypeError", "ValueError"}
            assert row["output_tok_s"] == 0 and row["speedup"] is None
    # the steps with their own workload are compared with the previous engine on it
    assert [r["workload"] for r in result["rows"]].count("shared-prefix") == 2
    assert [r["workload"] for r in result["rows"]].count("long-output") == 2
    reference, prefix_step = (r for r in result["rows"] if r["workload"] == "shared-prefix")
    assert reference["prefix_hit_rate"] == 0
    if prefix_step["available"]:
        assert prefix_step["engine_args"]["enable_prefix_caching"] is True
        assert prefix_step["prefix_hit_rate"] > 0
        assert prefix_step["speedup"] == pytest.approx(
            prefix_step["output_tok_s"] / reference["output_tok_s"]
        )


def test_ladder_outputs(ladder):
    _, result, paths = ladder
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = paths["md"].read_text()
    assert table == result["table"] + "\n"
    assert table.count("\n| ") == len(result["rows"])  # one line per row
    missing = [r for r in result["rows"] if not r["available"]]
    assert ("not available" in table) == bool(missing)


def test_ladder_bad_model(tmp_path, capsys):
    missing, result = str(tmp_path / "nope.gguf"), str(tmp_path / "x.json")
    assert main(["ladder", "--model", missing, "--no-progress", "--save-result", result]) == 2
    assert "cannot load" in capsys.readouterr().err
