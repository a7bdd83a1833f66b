"""studies.kv_tiers on a small scale: which arm serves which tokens from a cache, and
what its files hold (the times are the study's business, not a test's)."""

from __future__ import annotations

import json

from studies import kv_tiers

PREFIX, SUFFIX = 64, 4  # a tenant's 4 full blocks of 16, then a question


def test_the_study_counts_cached_tokens_per_arm_and_writes_its_files(tmp_path):
    argv = ["--out", str(tmp_path), "--tenants", "3", "--pool-prompts", "1", "--passes", "1"]
    argv += ["--prefix-len", str(PREFIX), "--suffix-len", str(SUFFIX), "--max-tokens", "2"]
    argv += ["--restart-prefix-len", str(PREFIX), "--repeats", "1"]
    kv_tiers.main([*argv, "--restart-models", "tiny-llama"])
    result = json.loads((tmp_path / "kv_tiers.json").read_text())
    assert (tmp_path / "kv_tiers.png").stat().st_size > 0
    device, host_disk, disk = result["capacity"]["arms"]
    # the pool holds one tenant's prompt and the requests cycle: the device alone
    # never finds one; the tiers find every tenant's 4 blocks of its prompt
    assert device["hit_rate"] == 0 and device["requests"] == 3
    for arm in (host_disk, disk):
        assert arm["requests"] == 3 and arm["hit_rate"] == PREFIX / (PREFIX + SUFFIX)
    assert host_disk["stats"]["kv_host_hits"] == 3 * PREFIX
    assert disk["stats"]["kv_disk_hits"] == 3 * PREFIX
    assert set(result["capacity"]["ratios"]) == {"host + disk tiers", "disk tier alone"}
    restart = result["restart"]["tiny-llama"]
    (rep,) = restart["repeats"]
    for variant in kv_tiers.RESTART_VARIANTS:
        assert rep[variant]["disk tier"]["cached_tokens"] == PREFIX
        assert rep[variant]["recomputed"]["cached_tokens"] == 0
        assert rep[variant]["files"] >= PREFIX // kv_tiers.BLOCK_SIZE  # blocks on disk
    assert restart["fill"]["cached_tokens"] == 0
