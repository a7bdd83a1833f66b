"""The disk tier's store (engine_api.kv_disk) and its records (engine_api.kv_records):
what comes back is what went in, under the same fingerprint, key and secret only."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine_api.kv_disk import STALE_TMP_S, SUFFIX, DiskStore
from engine_api.kv_records import HEADER_SIZE, RecordCodec, fingerprint

FP = fingerprint(model="m", block_size=16)
OTHER_FP = fingerprint(model="another", block_size=16)
SECRET = "the secret the gateways share, for tests"
CODEC = RecordCodec(FP, SECRET)
BLOCK = bytes(range(256)) * 4  # 1 KiB
RECORD = HEADER_SIZE + len(BLOCK)
ROOT = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return bytes([i]) * 32


def store_at(root: Path, blocks: int = 8) -> DiskStore:
    return DiskStore(root, blocks * RECORD, CODEC, RECORD)


def test_fingerprint_is_16_bytes_and_tells_parts_apart():
    assert len(FP) == 16
    assert fingerprint(block_size=16, model="m") == FP  # order does not matter
    assert OTHER_FP != FP


def test_a_record_decodes_only_under_its_fingerprint_and_key():
    data = CODEC.encode(key(1), BLOCK)
    assert bytes(CODEC.decode(data, key(1))) == BLOCK
    assert RecordCodec(OTHER_FP, SECRET).decode(data, key(1)) is None
    assert CODEC.decode(data, key(2)) is None
    assert CODEC.decode(data[:-1], key(1)) is None
    assert CODEC.decode(data + b"\0", key(1)) is None
    flipped = bytearray(data)
    flipped[HEADER_SIZE + 10] ^= 1
    assert CODEC.decode(bytes(flipped), key(1)) is None
    with pytest.raises(ValueError):
        RecordCodec(FP[:8], SECRET)


def test_round_trip_and_a_second_put_of_a_key_is_not_written(tmp_path):
    store = store_at(tmp_path)
    store.put(key(1), BLOCK)
    store.put(key(1), b"other bytes")
    assert key(1) in store and len(store) == 1
    assert bytes(store.get(key(1))) == BLOCK
    assert store.get(key(2)) is None
    assert (store.written, store.bytes, store.rejected) == (1, RECORD, 0)
    assert (tmp_path / FP.hex() / (key(1).hex() + SUFFIX)).is_file()


def test_the_least_recently_used_goes_past_the_capacity(tmp_path):
    store = store_at(tmp_path, blocks=3)
    for i in range(3):
        store.put(key(i), BLOCK)
    store.get(key(0))  # now the most recent
    store.put(key(3), BLOCK)
    assert key(1) not in store and {key(0), key(2), key(3)} == set(store.index)
    assert store.bytes == 3 * RECORD
    assert sorted(p.name for p in store.dir.iterdir()) == sorted(
        k.hex() + SUFFIX for k in (key(0), key(2), key(3))
    )
    store.put(key(9), BLOCK * 4)  # larger than the whole store: not kept
    assert key(9) not in store and len(store) == 3


def test_a_restart_finds_the_blocks_in_their_order_of_use(tmp_path):
    store = store_at(tmp_path)
    for i in range(3):
        store.put(key(i), BLOCK)
    for age, i in enumerate((1, 2, 0)):  # 1 used longest ago, 0 last
        os.utime(store.dir / (key(i).hex() + SUFFIX), (1000 + age, 1000 + age))
    again = store_at(tmp_path, blocks=2)  # smaller now: the oldest goes
    assert list(again.index) == [key(2), key(0)]
    assert bytes(again.get(key(0))) == BLOCK and again.bytes == 2 * RECORD


def test_a_restart_removes_what_an_interrupted_write_left(tmp_path):
    store = store_at(tmp_path)
    store.put(key(1), BLOCK)
    leftover = store.dir / (key(2).hex() + ".123-456.tmp")
    leftover.write_bytes(b"half a block")
    old = time.time() - STALE_TMP_S - 1
    os.utime(leftover, (old, old))
    # a young one may be another engine's write in progress in the same directory
    young = store.dir / (key(3).hex() + ".789-1.tmp")
    young.write_bytes(b"being written")
    again = store_at(tmp_path)
    assert not leftover.exists() and young.exists()
    assert list(again.index) == [key(1)]


@pytest.mark.parametrize("spoil", ["corrupt", "truncated", "foreign", "misnamed"])
def test_a_bad_file_is_rejected_deleted_and_not_served(tmp_path, spoil):
    store = store_at(tmp_path)
    store.put(key(1), BLOCK)
    path = tmp_path / FP.hex() / (key(1).hex() + SUFFIX)
    data = bytearray(path.read_bytes())
    if spoil == "corrupt":
        data[-1] ^= 0xFF
    elif spoil == "truncated":
        data = data[: len(data) // 2]
    elif spoil == "foreign":  # another model's block, copied in under this name
        data = RecordCodec(OTHER_FP, SECRET).encode(key(1), BLOCK)
    else:  # a block of another key, under this one's name
        data = CODEC.encode(key(2), BLOCK)
    path.write_bytes(data)  # under the running store
    assert key(1) in store
    assert store.get(key(1)) is None
    assert store.rejected == 1 and key(1) not in store and not path.exists()
    assert store.bytes == 0


FAILED_WRITE = """
import json, resource, signal, sys
from engine_api.kv_disk import DiskStore
from tests.engine_api.test_kv_disk import BLOCK, CODEC, RECORD, key

store = DiskStore(sys.argv[1], 8 * RECORD, CODEC, RECORD)
store.put(key(1), BLOCK)
# files past 100 bytes cannot be written (EFBIG, as a full disk's ENOSPC)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))
store.put(key(2), BLOCK)
errors, writable = store.write_errors, store.writable
store.put(key(3), BLOCK)  # stopped: not even tried
print(json.dumps({
    "first": [errors, writable], "errors": store.write_errors,
    "index": [k.hex() for k in store.index], "read": bytes(store.get(key(1))) == BLOCK,
}))
"""


def test_a_restart_deletes_the_records_it_could_never_read(tmp_path):
    """Told from their headers alone: another secret's (or an engine's with none),
    another key's, cut short; a damaged payload only shows at its read."""
    store = store_at(tmp_path)
    for i in range(5):
        store.put(key(i), BLOCK)
    files = [store.dir / (key(i).hex() + SUFFIX) for i in range(5)]
    files[0].write_bytes(RecordCodec(FP, "another gateway's secret").encode(key(0), BLOCK))
    files[1].write_bytes(RecordCodec(FP, None).encode(key(1), BLOCK))
    files[2].write_bytes(CODEC.encode(key(3), BLOCK))
    files[3].write_bytes(files[3].read_bytes()[:-1])
    damaged = bytearray(files[4].read_bytes())
    damaged[-1] ^= 1
    files[4].write_bytes(damaged)
    again = store_at(tmp_path)
    assert list(again.index) == [key(4)] and [f.exists() for f in files] == [False] * 4 + [True]
    assert again.get(key(4)) is None and again.rejected == 1


def test_a_failed_write_stops_writing_and_reads_go_on(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", FAILED_WRITE, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(run.stdout)
    assert out == {"first": [1, False], "errors": 1, "index": [key(1).hex()], "read": True}
    assert "no more blocks are written" in run.stderr


def test_a_symlink_at_a_writes_temporary_name_is_not_written_through(tmp_path):
    store = store_at(tmp_path / "kv")
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    tmp = store.dir / f"{key(1).hex()}.{os.getpid()}-{threading.get_ident()}.tmp"  # this writer's
    tmp.symlink_to(victim)
    store.put(key(1), BLOCK)
    assert victim.read_bytes() == b"someone else's file"
    assert (store.write_errors, store.writable) == (1, False) and key(1) not in store
    assert not tmp.is_symlink()  # the planted link is gone


def test_records_are_written_for_their_owner_alone(tmp_path):
    store = store_at(tmp_path)
    store.put(key(1), BLOCK)
    assert (store.dir / (key(1).hex() + SUFFIX)).stat().st_mode & 0o777 == 0o600


def test_an_unwritable_path_counts_a_write_error_and_stores_nothing(tmp_path):
    blocker = tmp_path / "kv"
    blocker.write_text("a file where the directory should be")
    store = store_at(blocker)
    assert (store.write_errors, store.writable) == (1, False)
    store.put(key(1), BLOCK)
    assert key(1) not in store and store.get(key(1)) is None
