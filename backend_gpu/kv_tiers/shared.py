"""A KV tier shared by every engine of the same model: blocks kept in Redis, so that a
prefix one worker computed serves another worker's requests (LMCache's remote backend
does the same). Values are stored blocks (engine_api.kv_records) under
"kvgate:kv:<fingerprint>:<key>", so engines of other models, dtypes or block sizes
never read each other's blocks. Whoever can write to that database is not trusted: a
value is read no further than a record's size, and one that does not check out
(another model's, cut short, or forged or swapped: its MAC, keyed by the secret the
gateways share, covers its key and bytes) is refused, deleted and computed again.

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

from engine_api.kv_records import RecordCodec

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5.0
TIMEOUT_S = 0.5
RECENT = 65536  # keys this engine wrote lately: not sent again


class SharedStore:
    def __init__(self, url: str, codec: RecordCodec, record_bytes: int) -> None:
        """`codec`: the engine's records; `record_bytes`: the size of each (a block's)."""
        self.client = redis.Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.url = url
        self.codec = codec
        self.record_bytes = record_bytes
        self.prefix = f"kvgate:kv:{codec.fp.hex()}:".encode()
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.recent: OrderedDict[bytes, None] = OrderedDict()
        self.written = 0
        self.rejected = 0  # values refused: another model's, cut short, forged
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
        # GETRANGE, not MGET: a value is read one byte past a record at most (a longer
        # one is refused), so a huge value someone stored costs no memory here
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self._name(key), 0, self.record_bytes)
        try:
            values = pipe.execute(raise_on_error=False)
        except redis.RedisError as e:
            self._failed(e)
            return [None] * len(keys)
        out: list[memoryview | None] = []
        for key, value in zip(keys, values, strict=True):
            # b"": absent; an error: a value that is no string (refused as any)
            payload = self.codec.decode(value, key) if isinstance(value, bytes) else None
            if payload is None and (isinstance(value, Exception) or value):
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
            self.client.set(self._name(key), self.codec.encode(key, payload))
        except redis.RedisError as e:
            self._failed(e)
            return
        with self.lock:
            self.written += 1
            self.recent[key] = None
            if len(self.recent) > RECENT:
                self.recent.popitem(last=False)
