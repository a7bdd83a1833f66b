"""A KV tier shared by every engine of the same model: blocks kept in Redis, so that a
prefix one worker computed serves another worker's requests (LMCache's remote backend
does the same). Values are stored blocks (engine_api.kv_records) under
"kvgate:kv:<fingerprint>:<key>", so engines of other models, dtypes or block sizes
never read each other's blocks, and a value that does not check out is refused.

The tier is optional in the strong sense: when Redis does not answer (down, slow,
refusing), the call fails fast (short timeouts), is counted in `errors`, and the tier
is left alone for RETRY_AFTER_S before it is tried again; the engine keeps serving and
computes what it would have loaded. Eviction is Redis's own (its maxmemory policy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import redis

from engine_api.kv_records import decode_record, encode_record

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5.0
TIMEOUT_S = 0.5
RECENT = 65536  # keys this engine wrote lately: not sent again


class SharedStore:
    def __init__(self, url: str, fp: bytes) -> None:
        self.client = redis.Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.url = url
        self.fp = fp
        self.prefix = f"kvgate:kv:{fp.hex()}:".encode()
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.recent: OrderedDict[bytes, None] = OrderedDict()
        self.written = 0
        self.rejected = 0  # values refused: another model's, cut short, corrupt
        self.errors = 0  # calls that failed: the store down or too slow

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _up(self) -> bool:
        return time.monotonic() >= self.down_until

    def _failed(self, error: Exception) -> None:
        with self.lock:
            self.errors += 1
            if self._up():
                log.warning(
                    "KV shared tier %s: %s; retrying in %.0f s", self.url, error, RETRY_AFTER_S
                )
            self.down_until = time.monotonic() + RETRY_AFTER_S

    def get_many(self, keys: list[bytes]) -> list[memoryview | None]:
        """The blocks of `keys` (None where absent or refused), in one round trip."""
        if not keys or not self._up():
            return [None] * len(keys)
        try:
            values = self.client.mget([self._name(k) for k in keys])
        except redis.RedisError as e:
            self._failed(e)
            return [None] * len(keys)
        out: list[memoryview | None] = []
        for key, value in zip(keys, values, strict=True):
            payload = None if value is None else decode_record(value, self.fp, key)
            if value is not None and payload is None:
                self._reject(key)
            out.append(payload)
        return out

    def _reject(self, key: bytes) -> None:
        """Count a value that does not check out and delete it: the block computed
        again is stored in its place."""
        with self.lock:
            self.rejected += 1
            self.recent.pop(key, None)
        try:
            self.client.delete(self._name(key))
        except redis.RedisError as e:
            self._failed(e)

    def put(self, key: bytes, payload: bytes | memoryview) -> None:
        """Store a block (from the writer thread); a failure only counts."""
        if key in self.recent or not self._up():
            return
        try:
            self.client.set(self._name(key), encode_record(self.fp, key, payload))
        except redis.RedisError as e:
            self._failed(e)
            return
        with self.lock:
            self.written += 1
            self.recent[key] = None
            if len(self.recent) > RECENT:
                self.recent.popitem(last=False)
