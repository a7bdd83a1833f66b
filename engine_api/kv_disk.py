"""A directory of stored KV blocks (engine_api.kv_records), least recently used out
past a size: the disk tier both engines keep under their caches, and what lets a
restarted engine serve its old prefixes without computing them again.

Files live under `root/<fingerprint>/`, one per block key, so engines of different
models (or dtypes, block sizes, ranks) can share a root without reading each other's
blocks; each file's header and MAC are checked all the same (a file copied in, cut
short, damaged or forged is deleted and reported as rejected, never used). A write
goes to a temporary name and is renamed into place, so a crash leaves no half a block
under a key.

Whoever can write to the directory must not be able to grow the server or stall it:
a file is opened without following a symlink and without blocking (a FIFO), read only
if it is a regular file no larger than a record can be (`max_record_bytes`), and
never past that. Anything else is refused like a bad record: a miss, counted, the
first one logged.

A full disk or a path that cannot be written stops writing (one warning, counted in
`write_errors`) and the engine keeps serving: reads of what is there go on.
Methods are safe to call from the engine's thread and a writer thread at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from engine_api.kv_records import HEADER_SIZE, RecordCodec

log = logging.getLogger(__name__)
SUFFIX = ".kvb"
STALE_TMP_S = 600
# a file is opened as it is: a symlink fails, and a FIFO opens without waiting for a writer
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskStore:
    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        codec: RecordCodec,
        max_record_bytes: int,
    ) -> None:
        """`codec`: the engine's records (fingerprint and MAC key); `max_record_bytes`:
        the largest record the engine writes, and so the most a read takes."""
        self.dir = Path(root) / codec.fp.hex()
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.max_record_bytes = max_record_bytes
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self.bytes = 0
        self.written = 0
        self.rejected = 0  # files refused at read: not a record, foreign, cut, forged
        self._refusal_logged = False
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
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                    os.unlink(entry.path)
            elif name.endswith(SUFFIX):
                try:
                    key = bytes.fromhex(name[: -len(SUFFIX)])
                except ValueError:
                    continue
                if (st := self._usable(entry.path, key)) is not None:
                    found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.bytes += size
        with self.lock:
            self._evict()

    def _usable(self, path: str, key: bytes) -> os.stat_result | None:
        """The stat of the file at `path` if its header says it is a record of `key` this
        store can read (format, fingerprint, secret, size); one that is not is deleted
        (an older format's, another secret's: none could ever be read), anything but a
        regular file left alone."""
        try:
            fd, st = self._open(path)
        except OSError:
            return None
        try:
            head = os.pread(fd, HEADER_SIZE, 0) if st.st_size <= self.max_record_bytes else b""
        finally:
            os.close(fd)
        if self.codec.head_matches(head, key, st.st_size):
            return st
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def get(self, key: bytes, max_bytes: int | None = None) -> memoryview | None:
        """The block stored under `key`, or None (absent, or refused and deleted);
        `max_bytes`: the most this record can be, when the caller knows it better than
        `max_record_bytes` does."""
        if key not in self.index:
            return None
        path = self._path(key)
        limit = (
            self.max_record_bytes if max_bytes is None else min(max_bytes, self.max_record_bytes)
        )
        try:
            payload = self.codec.decode(self._read(path, limit), key)
            why = "not a record of its key: another model's, an older format, cut, forged"
        except OSError as e:
            payload, why = None, e.strerror or str(e)
        with self.lock:
            if payload is None:
                if key in self.index:  # not counted twice when two threads read it
                    self.rejected += 1
                    self._drop(key)
                    self._log_refusal(path, why)
                return None
            if key in self.index:
                self.index.move_to_end(key)
        return payload

    @staticmethod
    def _open(path: str | Path) -> tuple[int, os.stat_result]:
        """A descriptor of the regular file at `path`, and its stat; OSError for anything
        else (a symlink is not followed, a FIFO not waited on)."""
        fd = os.open(path, _OPEN_READ)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OSError("not a regular file")
        return fd, st

    def _read(self, path: Path, limit: int) -> memoryview:
        """The file's bytes; OSError if it is not a regular file of at most `limit`
        bytes (nothing past that is read)."""
        fd, st = self._open(path)
        try:
            if st.st_size > limit:
                raise OSError(f"{st.st_size} bytes, more than a record")
            # one byte more than the size: a file that grew since fstat is seen
            data = memoryview(bytearray(st.st_size + 1))
            n = 0
            with open(fd, "rb", buffering=0, closefd=False) as f:
                while n < len(data) and (got := f.readinto(data[n:])):
                    n += got
            if n > st.st_size:
                raise OSError("more than a record: it grew while read")
            with contextlib.suppress(OSError):  # the order of use survives a restart
                os.utime(fd)
            return data[:n]
        finally:
            os.close(fd)

    def _log_refusal(self, path: Path, why: str) -> None:
        """The first refused file is logged; the rest are only counted (`rejected`)."""
        if not self._refusal_logged:
            self._refusal_logged = True
            log.warning(
                "KV disk tier: refused %s (%s) and computed its block again; further "
                "refusals are only counted (kv_disk_rejected)",
                path,
                why,
            )

    def put(self, key: bytes, payload: bytes | memoryview) -> None:
        """Store a block, evicting the least recently used past the capacity. Stops
        writing for good at the first error (a full disk, a read-only path)."""
        if not self.writable or key in self.index:
            return
        data = self.codec.encode(key, payload)
        if len(data) > min(self.capacity_bytes, self.max_record_bytes):
            return
        path = self._path(key)
        # a name of this writer's own: engines may share the directory
        tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            # never through a symlink someone put under the name
            with open(os.open(tmp, _OPEN_WRITE, 0o600), "wb") as f:
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
