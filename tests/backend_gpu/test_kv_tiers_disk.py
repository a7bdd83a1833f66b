"""The disk tier under the KV cache (kv_disk_path): blocks are written as they are
computed, a restarted engine serves them as cached tokens with the output unchanged,
a block keeps its tenant's salt there, and a file that is foreign, cut short,
damaged, forged, swapped, written under another secret or no record at all (a
symlink to /dev/zero, a FIFO, a 1 GiB sparse file) is a miss, recomputed, never used
(issue 45); a path that cannot be written keeps the engine serving."""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from backend_gpu import LLM, SamplingParams
from engine_api.block_hash import hash_blocks
from engine_api.kv_records import RecordCodec
from tests.requests import req

BS = 8
BLOCK_BYTES = (
    2 * 2 * BS * 2 * 16 * 4
)  # the tiny llama's block: layers x (K, V) x rows x heads x dims x 4
DEVICE_BLOCKS = 140
PROMPT_LEN = 1001  # a 1,000-token prefix (125 blocks) and one token to compute
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SECRET = "the secret the gateways share, for tests"


@pytest.fixture(scope="module")
def long_llama(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny llama with room for a 1,000-token prompt (its weights do not depend
    on the positions it allows)."""
    path = tmp_path_factory.mktemp("long") / "tiny-llama-2k"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _llm(model: str, disk: Path | None, **kwargs) -> LLM:
    if disk is not None:
        kwargs = {"kv_disk_path": str(disk), "kv_tier_secret": SECRET} | kwargs
    return LLM(
        model,
        block_size=BS,
        max_model_len=1024,
        kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK_BYTES,
        **kwargs,
    )


def _prompt(seed: int = 33, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 384) for _ in range(n)]


def _run(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
    """Greedy output and cached tokens of one request; the tiers' writes then flushed."""
    engine = llm.engine
    engine.add_request(req(f"r{engine.stats_.num_steps}", prompt, GREEDY, cache_salt=salt))
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, cached = out.token_ids, out.num_cached_tokens
    if engine.kv_tiers is not None:
        engine.kv_tiers.flush()
    return list(tokens), cached


def _restart(llm: LLM, model: str, disk: Path, **kwargs) -> LLM:
    llm.engine.close()
    return _llm(model, disk, **kwargs)


@pytest.fixture(scope="module")
def reference(long_llama) -> list[int]:
    return _run(_llm(long_llama, None), _prompt())[0]


def test_a_restart_serves_a_1000_token_prefix_from_disk_with_the_same_output(
    long_llama, reference, tmp_path
):
    first = _llm(long_llama, tmp_path)
    assert _run(first, _prompt()) == (reference, 0)
    stats = first.stats()
    assert stats.kv_disk_blocks == stats.kv_disk_blocks_written == 125
    assert stats.kv_disk_bytes > 125 * BLOCK_BYTES  # each file has a header too
    second = _restart(first, long_llama, tmp_path)
    assert second.stats().kv_disk_blocks == 125  # found at start
    assert _run(second, _prompt()) == (reference, 1000)
    stats = second.stats()
    assert stats.kv_disk_hits == 1000 and stats.prefix_hits == 1000
    assert stats.kv_disk_rejected == 0


def test_a_block_on_disk_is_not_found_under_another_salt(long_llama, reference, tmp_path):
    first = _llm(long_llama, tmp_path)
    assert _run(first, _prompt(), salt="tenant-a")[1] == 0
    second = _restart(first, long_llama, tmp_path)
    assert _run(second, _prompt(), salt="tenant-b") == (reference, 0)
    assert second.stats().kv_disk_hits == 0
    assert _run(second, _prompt(), salt="tenant-a") == (reference, 1000)


def _block_files(disk: Path) -> list[Path]:
    (fp_dir,) = [p for p in disk.iterdir() if p.is_dir()]
    return sorted(fp_dir.iterdir(), key=lambda p: p.stat().st_mtime_ns)


def _damage(path: Path, how: str, next_block: Path) -> None:
    """Spoil a stored block's file as whoever can write to the directory could (without
    the secret); `next_block`: the file of the block after it in the prompt."""
    data = path.read_bytes()
    key, fp = bytes.fromhex(path.stem), bytes.fromhex(path.parent.name)
    if how == "symlink to /dev/zero":
        path.unlink()
        path.symlink_to("/dev/zero")
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "sparse 1 GiB":  # its own header, then a hole
        with open(path, "r+b") as f:
            f.truncate(1 << 30)
    elif how == "corrupt":  # one bit of the payload
        path.write_bytes(data[:-7] + bytes([data[-7] ^ 1]) + data[-6:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "foreign":  # another model's block under this key's name
        path.write_bytes(RecordCodec(b"another model!!!", SECRET).encode(key, data[-BLOCK_BYTES:]))
    elif how == "forged":  # this model and key, chosen bytes, keyed by a guessed secret
        path.write_bytes(RecordCodec(fp, "a guess").encode(key, bytes(BLOCK_BYTES)))
    else:  # "swapped": the next block's valid record, its header naming this block
        swapped = bytearray(next_block.read_bytes())
        swapped[24:56] = key
        path.write_bytes(swapped)


SPOILS = ["corrupt", "truncated", "foreign", "forged", "swapped"]
SPOILS += ["symlink to /dev/zero", "fifo", "sparse 1 GiB"]


@pytest.mark.parametrize("how", SPOILS)
def test_a_bad_block_file_is_recomputed_never_used(long_llama, reference, tmp_path, how):
    first = _llm(long_llama, tmp_path)
    _run(first, _prompt())
    second = _restart(first, long_llama, tmp_path)
    by_key = {p.stem: p for p in _block_files(tmp_path)}
    keys = hash_blocks(_prompt()[:1000], BS, None)
    # the 10th block of the chain, spoiled under the running engine: the first 9 still
    # load, the rest are recomputed
    _damage(by_key[keys[9].hex()], how, by_key[keys[10].hex()])
    assert _run(second, _prompt()) == (reference, 9 * BS)
    stats = second.stats()
    assert stats.kv_disk_rejected == 1 and stats.kv_disk_hits == 9 * BS
    # the bad file is gone, and the block computed again was written again
    assert stats.kv_disk_blocks == 125 and stats.kv_disk_blocks_written == 1


def test_blocks_written_under_another_secret_are_dropped_at_start(long_llama, reference, tmp_path):
    """Their headers name another key: the restart deletes them all, and stores the
    blocks computed again in their place."""
    first = _llm(long_llama, tmp_path, kv_tier_secret="another gateway's secret")
    _run(first, _prompt())
    second = _restart(first, long_llama, tmp_path)
    assert second.stats().kv_disk_blocks == 0
    assert _run(second, _prompt()) == (reference, 0)
    assert second.stats().kv_disk_blocks_written == 125
    assert _run(_restart(second, long_llama, tmp_path), _prompt()) == (reference, 1000)


def test_an_unwritable_path_keeps_the_engine_serving(long_llama, reference, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    llm = _llm(long_llama, blocker)
    assert _run(llm, _prompt()) == (reference, 0)
    assert _run(llm, _prompt()) == (reference, 1000)  # the device still caches
    stats = llm.stats()
    assert stats.kv_disk_write_errors >= 1 and stats.kv_disk_blocks == 0
    assert "no more blocks are written there" in caplog.text


def test_device_evictions_come_back_from_the_disk_tier_with_the_same_output(long_llama, tmp_path):
    """A device pool of 140 blocks and prompts of 62 blocks each: four prompts evict
    each other; with the disk tier (and only the staging rows in host memory) every
    second visit is a hit."""
    prompts = [_prompt(seed, 497) for seed in range(4)]
    plain = _llm(long_llama, None)
    tiered = _llm(long_llama, tmp_path)
    plain_runs = [_run(plain, p) for p in prompts * 2]
    tiered_runs = [_run(tiered, p) for p in prompts * 2]
    assert [t for t, _ in tiered_runs] == [t for t, _ in plain_runs]
    assert [c for _, c in tiered_runs[4:]] == [496] * 4
    assert sum(c for _, c in plain_runs[4:]) < 4 * 496
    assert tiered.stats().kv_disk_hits > 0


def test_lower_tier_events_tell_a_router_what_the_engine_still_holds(long_llama, tmp_path):
    first = _llm(long_llama, tmp_path, enable_kv_events=True)
    _run(first, _prompt())
    first.engine.take_kv_events()
    second = _restart(first, long_llama, tmp_path, enable_kv_events=True)
    events = second.engine.take_kv_events()
    lower = {e.block_hash for e in events if e.medium == "lower" and e.kind == "stored"}
    assert lower == set(hash_blocks(_prompt()[:1000], BS, None))


def test_a_waiting_requests_blocks_are_read_ahead_from_disk(long_llama, reference, tmp_path):
    first = _llm(long_llama, tmp_path)
    _run(first, _prompt())
    second = _restart(first, long_llama, tmp_path)
    engine = second.engine
    engine.add_request(req("read-ahead", _prompt(), GREEDY))
    engine.kv_tiers.flush()  # the read-ahead is done before the first step looks up
    assert second.stats().kv_prefetched_blocks == 125
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, cached = out.token_ids, out.num_cached_tokens
    assert (list(tokens), cached) == (reference, 1000)
    assert second.stats().kv_disk_hits == 1000


def test_a_block_is_lower_from_its_write_to_disk_on(long_llama, tmp_path):
    llm = _llm(long_llama, tmp_path, enable_kv_events=True)
    _run(llm, _prompt())
    events = llm.engine.take_kv_events()
    lower = [e.block_hash for e in events if e.medium == "lower"]
    device = [e.block_hash for e in events if e.medium == "device" and e.kind == "stored"]
    assert lower == device[:125] and all(e.kind == "stored" for e in events)


def test_an_engine_dropped_without_close_stops_its_tier_threads(long_llama, reference, tmp_path):
    """The threads hold the tiers, not the engine: once the engine is gone they end,
    after writing what was queued (a test or a script that never calls close() leaves
    no threads behind, nor the host rows they held)."""
    llm = _llm(long_llama, tmp_path)
    tiers = llm.engine.kv_tiers
    llm.engine.add_request(req("dropped", _prompt(), GREEDY))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    del llm
    gc.collect()
    for thread in (tiers.writer, tiers.prefetcher):
        thread.join(30)
        assert not thread.is_alive(), thread.name
    again = _llm(long_llama, tmp_path)
    assert _run(again, _prompt()) == (reference, 1000)
    again.engine.close()
