"""Whoever can write to the disk tier's directory is not trusted (issue 45): a stored
block replaced by a symlink (to /dev/zero, or to a valid record), a FIFO, a device, a
directory or a file larger than a record is never read past a record's size nor waited
on, and is a miss, counted, the first one logged; a record forged or swapped (another
key's valid record moved under this name, its header rewritten or not) or an old
CRC-only one fails its MAC and is a miss too."""

import json
import logging
import os
import stat
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from engine_api.kv_disk import SUFFIX, DiskStore
from engine_api.kv_records import HEADER_SIZE, MAGIC, RecordCodec, fingerprint

FP = fingerprint(model="m", block_size=16)
SECRET = "the secret the gateways share, for tests"
CODEC = RecordCodec(FP, SECRET)
BLOCK = bytes(range(256)) * 4  # 1 KiB
RECORD = HEADER_SIZE + len(BLOCK)
GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
HOSTILE = [
    "symlink to /dev/zero",
    "symlink to a valid record",
    "fifo",
    "device",
    "directory",
    "sparse 1 GiB",
]


def key(i: int) -> bytes:
    return bytes([i]) * 32


def stored(root: Path, *keys: bytes) -> DiskStore:
    store = DiskStore(root, 8 * RECORD, CODEC, RECORD)
    for k in keys:
        store.put(k, BLOCK)
    return store


def file_of(store: DiskStore, k: bytes) -> Path:
    return store.dir / (k.hex() + SUFFIX)


def replace_with(path: Path, what: str) -> None:
    """Put `what` where a stored block's file was."""
    record = path.read_bytes()
    path.unlink()
    if what == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")
    elif what == "symlink to a valid record":
        elsewhere = path.parent.parent / "elsewhere"
        elsewhere.write_bytes(record)
        path.symlink_to(elsewhere)
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "device":
        try:  # /dev/zero's numbers
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    elif what == "directory":
        path.mkdir()
    else:  # the record's own valid header, then a hole to 1 GiB
        with open(path, "wb") as f:
            f.write(record[:HEADER_SIZE])
            f.truncate(GIB)


@pytest.mark.parametrize("what", HOSTILE)
def test_a_file_that_is_no_record_is_a_miss_counted_and_logged_once(tmp_path, what, caplog):
    store = stored(tmp_path, key(1), key(2))
    replace_with(file_of(store, key(1)), what)
    replace_with(file_of(store, key(2)), what)
    with caplog.at_level(logging.WARNING, "engine_api.kv_disk"):
        assert store.get(key(1)) is None and store.get(key(2)) is None
    assert store.rejected == 2 and len(store) == 0 and store.bytes == 0
    (line,) = [r.getMessage() for r in caplog.records]  # the first refusal only
    assert "refused" in line and key(1).hex() in line
    if what != "directory":  # the entry itself is gone (a link, not its target)
        assert not os.path.lexists(file_of(store, key(1)))
    assert (tmp_path / "elsewhere").exists() or what != "symlink to a valid record"
    # the block computed again is stored again, in place of whatever was there
    if what != "directory":
        store.put(key(1), BLOCK)
        assert bytes(store.get(key(1))) == BLOCK


@pytest.mark.parametrize("what", HOSTILE)
def test_a_restart_does_not_index_a_file_that_is_no_record(tmp_path, what):
    store = stored(tmp_path, key(1), key(2))
    replace_with(file_of(store, key(1)), what)
    again = stored(tmp_path)
    assert list(again.index) == [key(2)] and again.bytes == RECORD
    assert again.get(key(1)) is None and bytes(again.get(key(2))) == BLOCK


HOSTILE_READS = """
import json, resource, sys
from pathlib import Path
from engine_api.kv_disk import DiskStore
from tests.engine_api.test_kv_disk_untrusted import (
    BLOCK, CODEC, RECORD, file_of, key, replace_with,
)

store = DiskStore(sys.argv[1], 8 * RECORD, CODEC, RECORD)
kinds = ["symlink to /dev/zero", "fifo", "sparse 1 GiB"]
for i, kind in enumerate(kinds):
    store.put(key(i), BLOCK)
    replace_with(file_of(store, key(i)), kind)
# an address space 256 MiB past what is mapped now: a whole read of any of them fails
size_kib = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0])
limit = (size_kib << 10) + (256 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = [store.get(key(i)) for i in range(len(kinds))]
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"got": [g is None for g in got], "rejected": store.rejected, "kib": grew}))
"""


def test_hostile_files_cost_no_memory_and_never_block(tmp_path):
    """In a process of its own, its address space capped 256 MiB above what it maps:
    reading /dev/zero or a 1 GiB file whole would fail there (and a FIFO with no
    writer would block the open forever: the timeout only ends a hung run)."""
    run = subprocess.run(
        [sys.executable, "-c", HOSTILE_READS, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["got"] == [True, True, True] and out["rejected"] == 3
    assert out["kib"] < 16 << 10  # peak RSS grew by less than 16 MiB, not by 1 GiB


def test_a_file_that_grows_past_a_record_is_refused_without_reading_on(tmp_path):
    store = stored(tmp_path, key(1))
    with open(file_of(store, key(1)), "ab") as f:
        f.write(b"\0")
    assert store.get(key(1)) is None and store.rejected == 1


def _v1_record(k: bytes, payload: bytes) -> bytes:
    """A record as written before issue 45: a CRC-32 where the MAC is now."""
    head = struct.pack("<4sHH16s32sQI", MAGIC, 1, 0, FP, k, len(payload), zlib.crc32(payload))
    return head + payload


def _spoiled(store: DiskStore, how: str) -> bytes:
    """key(1)'s file as `how` says, by someone who can write to the directory but does
    not know the secret."""
    if how == "forged":  # chosen bytes, framed as the format says, keyed by a guess
        return RecordCodec(FP, "a guessed secret").encode(key(1), b"\x7f" * len(BLOCK))
    if how == "swapped":  # another block's valid record, under this block's name
        return file_of(store, key(2)).read_bytes()
    if how == "swapped, header rewritten":  # ... and its header naming this block
        data = bytearray(file_of(store, key(2)).read_bytes())
        data[24:56] = key(1)  # after magic, version, 0 and the fingerprint
        return bytes(data)
    return _v1_record(key(1), BLOCK)  # "old format": valid once, no MAC


@pytest.mark.parametrize("how", ["forged", "swapped", "swapped, header rewritten", "old format"])
def test_a_forged_or_swapped_record_is_a_miss(tmp_path, how):
    store = stored(tmp_path, key(1), key(2))
    data = _spoiled(store, how)
    file_of(store, key(1)).write_bytes(data)
    assert store.get(key(1)) is None
    assert store.rejected == 1 and key(1) not in store
    assert bytes(store.get(key(2))) == BLOCK  # the other block is untouched


def test_engines_without_the_secret_read_no_one_elses_records(caplog):
    """No secret: a key of the engine's own, so its records are good for it alone,
    which it says once."""
    a, b = RecordCodec(FP, None), RecordCodec(FP, None)
    with caplog.at_level(logging.WARNING, "engine_api.kv_records"):
        record = a.encode(key(1), BLOCK)
        a.encode(key(2), BLOCK)
    assert bytes(a.decode(record, key(1))) == BLOCK
    assert b.decode(record, key(1)) is None
    assert RecordCodec(FP, SECRET).decode(record, key(1)) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "kv_tier_secret" in line
    assert RecordCodec(FP, SECRET).decode(CODEC.encode(key(1), BLOCK), key(1)) is not None
