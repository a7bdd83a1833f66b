"""A directory of stored KV blocks (engine_api.kv_records), least recently used out
past a size: the disk tier both engines keep under their caches, and what lets a
restarted engine serve its old prefixes without computing them again.

Files live under `root/<fingerprint>/`, one per block key, so engines of different
models (or dtypes, block sizes, ranks) can share a root without reading each other's
blocks; each file's header is checked all the same (a file copied in, cut short or
damaged is deleted and reported as rejected, never used). A write goes to a temporary
name and is renamed into place, so a crash leaves no half a block under a key.

A full disk or a path that cannot be written stops writing (one warning, counted in
`write_errors`) and the engine keeps serving: reads of what is there go on.
Methods are safe to call from the engine's thread and a writer thread at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from engine_api.kv_records import decode_record, encode_record

log = logging.getLogger(__name__)
SUFFIX = ".kvb"
STALE_TMP_S = 600


class DiskStore:
    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fp: bytes) -> None:
        self.dir = Path(root) / fp.hex()
        self.capacity_bytes = capacity_bytes
        self.fp = fp
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self.bytes = 0
        self.written = 0
        self.rejected = 0  # files refused at read: foreign, truncated, corrupt
        self.write_errors = 0
        self.writable = True
        # told each key that leaves the store (any thread): a tier above keeps track
        self.on_drop: Callable[[bytes], None] | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._stop_writing(e)

    def _scan(self) -> None:
        """Index the blocks an earlier run left, oldest use first."""
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(".tmp"):
                # a write a crash interrupted; a young one may be another engine's,
                # writing into the same directory right now
                if time.time() - entry.stat().st_mtime > STALE_TMP_S:
                    os.unlink(entry.path)
            elif name.endswith(SUFFIX):
                try:
                    key = bytes.fromhex(name[: -len(SUFFIX)])
                except ValueError:
                    continue
                st = entry.stat()
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.bytes += size
        with self.lock:
            self._evict()

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def get(self, key: bytes) -> memoryview | None:
        """The block stored under `key`, or None (absent, or refused and deleted)."""
        if key not in self.index:
            return None
        path = self._path(key)
        try:
            payload = decode_record(path.read_bytes(), self.fp, key)
        except OSError:
            payload = None
        with self.lock:
            if payload is None:
                if key in self.index:  # not counted twice when two threads read it
                    self.rejected += 1
                    self._drop(key)
                return None
            if key in self.index:
                self.index.move_to_end(key)
        with contextlib.suppress(OSError):  # the order of use survives a restart
            os.utime(path)
        return payload

    def put(self, key: bytes, payload: bytes | memoryview) -> None:
        """Store a block, evicting the least recently used past the capacity. Stops
        writing for good at the first error (a full disk, a read-only path)."""
        if not self.writable or key in self.index:
            return
        data = encode_record(self.fp, key, payload)
        if len(data) > self.capacity_bytes:
            return
        path = self._path(key)
        # a name of this writer's own: engines may share the directory
        tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._stop_writing(e)
            return
        with self.lock:
            self.index[key] = len(data)
            self.bytes += len(data)
            self.written += 1
            self._evict()

    def _evict(self) -> None:
        while self.bytes > self.capacity_bytes and self.index:
            self._drop(next(iter(self.index)))

    def _drop(self, key: bytes) -> None:
        size = self.index.pop(key, None)
        if size is None:
            return
        self.bytes -= size
        with contextlib.suppress(OSError):
            self._path(key).unlink(missing_ok=True)
        if self.on_drop is not None:
            self.on_drop(key)

    def _stop_writing(self, error: OSError) -> None:
        self.write_errors += 1
        if self.writable:
            log.warning("KV disk tier %s: %s; no more blocks are written there", self.dir, error)
        self.writable = False
