"""One stored KV block, as every tier below the device keeps it (a disk file, a shared
store's value, a transfer between workers): a header, then the block's bytes.

The header carries the fingerprint of what produced the block (the model and its
revision, dtypes, KV scales, block size, tensor-parallel rank and size: the engine
builds it, `fingerprint` hashes it), the block's key (its salted chain hash,
engine_api.block_hash), the payload's size, an id of the MAC key (derived from it, so
that a record of another secret shows from the header alone) and the MAC:
HMAC-SHA256 over all of the header before it and the payload, keyed by a secret the
gateways share (`kv_tier_secret`). A reader asks for a key under its own fingerprint
and gets the bytes only when all of it matches. A file another model wrote, one cut
short or damaged, and one forged or swapped by whoever can write to the directory or
the Redis database (a changed block, or another tenant's valid record moved under this
key) is refused, never used, and the block is computed again: a CRC would let anyone
who can write there choose a tenant's output, and have it billed as cached.

An engine given no secret draws one of its own: the records it writes are then good
for it alone (not after a restart, nor for another engine), and it says so once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import struct

log = logging.getLogger(__name__)
MAGIC = b"KVGB"
VERSION = 2  # 1 had a CRC-32 in place of the MAC: refused as any record that fails
# magic, version, 0, fingerprint, key, payload size, key id (which secret wrote it)
_HEAD = struct.Struct("<4sHH16s32sQ8s")
TAG_SIZE = 32  # HMAC-SHA256
HEADER_SIZE = _HEAD.size + TAG_SIZE
_KEY_LABEL = b"kvgate kv tier records"
_KEY_ID_LABEL = b"kvgate kv tier key id"


def fingerprint(**parts: object) -> bytes:
    """16 bytes naming what produced a block: equal parts, equal fingerprint."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()[:16]


class RecordCodec:
    """Records of one engine: its fingerprint `fp`, and the MAC key drawn from `secret`
    (None or empty: a random key of this codec's own)."""

    def __init__(self, fp: bytes, secret: str | None) -> None:
        if len(fp) != 16:
            raise ValueError("a record's fingerprint is 16 bytes")
        self.fp = fp
        self.shared = bool(secret)
        base = secret.encode() if secret else secrets.token_bytes(32)
        # a key for this use alone, so the secret itself never keys anything else
        self._key = hmac.digest(base, _KEY_LABEL, "sha256")
        # names the key in every header, so that a reader tells a record of another
        # secret (or none) from its header alone; it says nothing of the key itself
        self._key_id = hmac.digest(self._key, _KEY_ID_LABEL, "sha256")[:8]
        self._warned = False

    def _tag(self, head: bytes, payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, head, "sha256")
        mac.update(payload)
        return mac.digest()

    def encode(self, key: bytes, payload: bytes | memoryview) -> bytes:
        """`payload` (a block's bytes) as the record of `key`."""
        if len(key) > 32:
            raise ValueError("a record's key is at most 32 bytes")
        if not self.shared and not self._warned:
            self._warned = True
            log.warning(
                "KV tiers: no kv_tier_secret, so the KV blocks this engine stores are "
                "readable by it alone (not after a restart, nor by another engine)"
            )
        head = _HEAD.pack(MAGIC, VERSION, 0, self.fp, key, len(payload), self._key_id)
        return head + self._tag(head, payload) + bytes(payload)

    def head_matches(self, head: bytes | memoryview, key: bytes, size: int) -> bool:
        """Whether `head` (a record's first HEADER_SIZE bytes, or more) names a record
        of `key`, `size` bytes in all, of this format, fingerprint and secret: all that
        can be told without its payload (the MAC needs that)."""
        if len(head) < HEADER_SIZE:
            return False
        magic, version, _, rec_fp, rec_key, payload_size, key_id = _HEAD.unpack_from(head)
        return (
            (magic, version, rec_fp, key_id) == (MAGIC, VERSION, self.fp, self._key_id)
            and rec_key == key.ljust(32, b"\0")
            and size == HEADER_SIZE + payload_size
        )

    def decode(self, data: bytes | memoryview, key: bytes) -> memoryview | None:
        """The payload of `data` if it is a whole record of `key`, written under this
        fingerprint with this key; None for anything else (another model's, an old
        version's, cut short, damaged, forged or swapped)."""
        view = memoryview(data)
        if not self.head_matches(view, key, len(view)):
            return None
        payload = view[HEADER_SIZE:]
        tag = self._tag(view[: _HEAD.size], payload)
        return payload if hmac.compare_digest(tag, view[_HEAD.size : HEADER_SIZE]) else None
