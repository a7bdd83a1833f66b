"""One stored KV block, as every tier below the device keeps it (a disk file, a shared
store's value, a transfer between workers): a header, then the block's bytes.

The header carries the fingerprint of what produced the block (the model and its
revision, dtypes, KV scales, block size, tensor-parallel rank and size: the engine
builds it, `fingerprint` hashes it), the block's key (its salted chain hash,
engine_api.block_hash) and a checksum of the bytes. A reader asks for a key under its
own fingerprint and gets the bytes only when all of it matches: a file another model
wrote, one that was cut short or one that was damaged is refused, never used, and the
block is computed again. The key in the header guards against a record stored under
the wrong name.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

MAGIC = b"KVGB"
VERSION = 1
_HEAD = struct.Struct("<4sHH16s32sQI")  # magic, version, 0, fingerprint, key, size, crc32
HEADER_SIZE = _HEAD.size


def fingerprint(**parts: object) -> bytes:
    """16 bytes naming what produced a block: equal parts, equal fingerprint."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()[:16]


def encode_record(fp: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """`payload` (a block's bytes) under `key` and fingerprint `fp`."""
    if len(fp) != 16 or len(key) > 32:
        raise ValueError("a record's fingerprint is 16 bytes and its key at most 32")
    crc = zlib.crc32(payload)
    return _HEAD.pack(MAGIC, VERSION, 0, fp, key, len(payload), crc) + bytes(payload)


def decode_record(data: bytes | memoryview, fp: bytes, key: bytes) -> memoryview | None:
    """The payload of `data` if it is a whole, undamaged record of `key` written under
    fingerprint `fp`; None for anything else (another model's, cut short, corrupt)."""
    if len(data) < HEADER_SIZE:
        return None
    magic, version, _, rec_fp, rec_key, size, crc = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION or rec_fp != fp:
        return None
    if rec_key != key.ljust(32, b"\0") or len(data) != HEADER_SIZE + size:
        return None
    payload = memoryview(data)[HEADER_SIZE:]
    return payload if zlib.crc32(payload) == crc else None
