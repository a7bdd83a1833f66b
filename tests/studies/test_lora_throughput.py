"""studies.lora_throughput on a small scale: every arm serves every request in full,
the naive arm swaps models and the cold arm times each trial (the times themselves
are the study's business, not a test's)."""

from __future__ import annotations

import json

from studies import lora_throughput

STREAMS, PER_STREAM, MAX_TOKENS = 3, 2, 3


def test_every_arm_serves_the_whole_workload_and_writes_its_files(tmp_path):
    argv = ["--out", str(tmp_path), "--hidden", "64", "--layers", "2", "--heads", "4"]
    argv += ["--vocab", "512", "--adapters", "3", "--rank", "4", "--streams", str(STREAMS)]
    argv += ["--per-stream", str(PER_STREAM), "--prompt-lens", "8", "16"]
    argv += ["--max-tokens", str(MAX_TOKENS), "--cold-trials", "2", "--kv-cache-mib", "8"]
    lora_throughput.main(argv)
    result = json.loads((tmp_path / "lora_throughput.json").read_text())
    assert (tmp_path / "lora_throughput.png").stat().st_size > 0
    arms = result["arms"]
    for name in ("base", "mixed", "naive"):
        assert arms[name]["requests"] == STREAMS * PER_STREAM
        assert arms[name]["output_tokens"] == STREAMS * PER_STREAM * MAX_TOKENS
    # the first request picks a model, and a request for another adapter swaps it
    adapters = {
        r.adapter for s in lora_throughput.make_streams(lora_throughput.parse_args(argv)) for r in s
    }
    assert arms["naive"]["swaps"] >= len(adapters) and arms["base"]["swaps"] == 0
    assert arms["mixed"]["stats"]["lora_loads"] >= len(adapters)
    assert len(arms["cold"]["trials"]) == 2
    assert set(result["ratios"]) == {"mixed_over_base", "mixed_over_naive"}
