"""The tiers under the KV cache as the block manager sees them (its LowerTier): host
rows on top, least recently used out, and under them, written through by a thread, a
disk directory that outlives the engine and a store shared with other engines.

Every tier is keyed by the block's salted chain hash (engine_api.block_hash), the key
the device pool uses, so tenant isolation holds in each exactly as there: a block
computed under tenant A's salt sits under a key that tenant B's prompt never produces.

- Down: a block is put on disk and in the shared store as soon as it is computed
  (`computed`: a copy of it goes to the writer thread, which writes off the step's
  critical path), so a restart or another engine finds it even if this device never
  evicts it. A block the device evicts is copied into a host row (kv_tiers.host; on
  CUDA a side stream); if the tiers below do not have it yet, the row is queued for
  the writer, and is not reused until written. Past MAX_QUEUED blocks waiting, new
  ones are not queued (a slow disk never holds up the engine or fills memory).
- Up: a prefix lookup (`leading_hits`) walks the prompt's block keys past the device's
  hits: a key in host memory is a hit as it is; one on disk or in the shared store is
  read, checked (fingerprint, key, MAC: engine_api.kv_records) and put in a host
  row, then counted. So a block is only ever loaded onto the device from a host row,
  and a bad one is never a hit: it is recomputed.
- Ahead of the lookup: when a request arrives, `prefetch` hands its prompt's keys
  past the device's hits to a second thread, which reads and checks what the disk and
  the shared store hold while the request waits its turn and other requests' steps
  run; the lookup then takes those blocks from memory (at most MAX_PREFETCHED held).
  A lookup that reaches a key the read-ahead has not got to yet waits for it (at most
  READ_WAIT_S) rather than reading the same file a second time.
- The rows a lookup found are reserved until the next lookup, and the rows being
  loaded until their copy, so that the evictions the new blocks cause never take them.
- The host rows include what was loaded (a block loaded back stays in its row), so a
  block evicted again from the device costs no second copy.

With events on, a block entering the engine's own lower tiers (host or disk) is
"stored" with medium "lower", and "removed" when it has left both, so a router can
rank this replica for a prefix it holds below the device.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable

from backend_gpu.block_manager import KVCacheEvent
from backend_gpu.kv_tiers.host import HostRows
from backend_gpu.kv_tiers.shared import SharedStore
from engine_api.kv_disk import DiskStore
from engine_api.kv_records import RecordCodec

log = logging.getLogger(__name__)
HOST, DISK, SHARED, TRANSFER = "host", "disk", "shared", "transfer"
MAX_QUEUED = 4096
MAX_PREFETCHED = 1024
READ_WAIT_S = 5.0


class TierStack:
    def __init__(
        self,
        rows: HostRows,
        codec: RecordCodec,
        disk: DiskStore | None = None,
        shared: SharedStore | None = None,
        enable_events: bool = False,
        keeps_evicted: bool = True,
    ) -> None:
        """`keeps_evicted`: the rows are a host tier (kv_offload_gb), not only a staging
        area: a block the device evicts is kept in a row even if the disk has it."""
        self.rows = rows
        self.codec = codec
        self.keeps_evicted = keeps_evicted
        self.block_size = rows.block_size
        self.disk = disk
        self.shared = shared
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> row, oldest first
        self.free_rows = list(range(rows.num_rows))
        self.reserved: set[int] = set()  # found by the last lookup
        self.loading: set[int] = set()  # taken, not yet copied up
        self.writing: set[int] = set()  # queued for the writer thread
        self.origin: dict[bytes, str] = {}  # key -> the tier it was read from
        self.hits = {HOST: 0, DISK: 0, SHARED: 0, TRANSFER: 0}  # prompt tokens loaded, by tier
        self.blocks_exported = 0  # sent to another engine (prefill apart from decode)
        self.blocks_imported = 0
        self.import_rejected = 0
        self.blocks_written = 0  # into host rows
        self.blocks_loaded = 0  # from host rows onto the device
        self.lock = threading.Lock()  # the writer's share: `writing` and `events`
        self.events: list[KVCacheEvent] | None = [] if enable_events else None
        self.disk_dropped: deque[bytes] = deque()  # keys the disk let go (writer thread)
        if disk is not None:
            disk.on_drop = self.disk_dropped.append
            for key in list(disk.index):  # a restart: what the disk still holds
                self._event("stored", key)
        # (key, host row or None, else a snapshot and its CUDA event)
        self.queue: queue.Queue[tuple | None] = queue.Queue()
        self.queued: set[bytes] = set()  # keys waiting for the writer
        self.writer = None
        # keys to read ahead, and what was read: key -> (payload, tier)
        self.to_prefetch: queue.Queue[list[bytes] | None] = queue.Queue()
        self.prefetched: OrderedDict[bytes, tuple[memoryview, str]] = OrderedDict()
        self.unread: dict[bytes, int] = {}  # keys asked for, not yet read: how many asks
        self.arrived = threading.Condition(self.lock)  # a key was read or given up
        self.blocks_prefetched = 0
        self.prefetcher = None
        if disk is not None or shared is not None:
            self.writer = threading.Thread(target=self._write_loop, name="kv-tiers", daemon=True)
            self.writer.start()
            self.prefetcher = threading.Thread(
                target=self._prefetch_loop, name="kv-prefetch", daemon=True
            )
            self.prefetcher.start()

    # -- the block manager's side (the engine thread) ----------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots or (self.disk is not None and key in self.disk)

    def leading_hits(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, some tier holds: each is then in a host
        row, reserved for `take`."""
        self.reserved.clear()
        found = 0
        for key in keys:
            row = self.slots.get(key)
            if row is None:
                payload, origin = self._prefetched(key)
                if payload is None and self.disk is not None:
                    payload = self.disk.get(key)
                if payload is None or not self._promote(key, payload, origin):
                    break
                row = self.slots[key]
            else:
                self.slots.move_to_end(key)
            self.reserved.add(row)
            found += 1
        if self.shared is not None and found < len(keys):
            for key, payload in zip(keys[found:], self.shared.get_many(keys[found:]), strict=True):
                if payload is None or not self._promote(key, payload, SHARED):
                    break
                self.reserved.add(self.slots[key])
                self._event("stored", key)
                found += 1
        return found

    def write_down(self, block_id: int, key: bytes) -> None:
        """Copy device block `block_id` (about to be overwritten) into a host row and
        queue it for the tiers below. Dropped when no row can be reused."""
        if key in self.slots:  # same key, same contents: just fresher
            self.slots.move_to_end(key)
            return
        if not self.keeps_evicted and not self._wants(key):
            return  # staging rows only, and the tiers below have it or will
        row = self._acquire_row()
        if row is None:
            return
        self.rows.copy_down(row, block_id)
        if not self._on_disk(key):
            self._event("stored", key)
        self.slots[key] = row
        self.blocks_written += 1
        if self._wants(key):
            with self.lock:
                self.writing.add(row)
            self._enqueue((key, row, None, None))

    def computed(self, block_id: int, key: bytes) -> None:
        """Block `block_id` was just computed under `key`: send a copy of it to the
        tiers below (nothing when there are none: host rows fill on eviction)."""
        if self._wants(key):
            if self.disk is not None and key not in self.slots and not self._on_disk(key):
                self._event("stored", key)
            self._enqueue((key, None, *self.rows.snapshot(block_id)))

    def _on_disk(self, key: bytes) -> bool:
        """Whether the disk has `key`, or will once the writer gets to it."""
        return self.disk is not None and (key in self.disk or key in self.queued)

    def _wants(self, key: bytes) -> bool:
        """Whether the tiers below lack `key` and nothing is queued for it yet."""
        if key in self.queued or len(self.queued) >= MAX_QUEUED:
            return False
        wanted_by_disk = self.disk is not None and self.disk.writable and key not in self.disk
        return wanted_by_disk or (self.shared is not None and key not in self.shared.recent)

    def _enqueue(self, item: tuple) -> None:
        with self.lock:
            self.queued.add(item[0])
        self.queue.put(item)

    def take(self, keys: list[bytes]) -> tuple[list[int], int]:
        """The rows of `keys` (all found by the last lookup), held until `load`, and how
        many of them another engine computed for this request (not cached tokens)."""
        rows = [self.slots[key] for key in keys]
        transferred = 0
        for key in keys:
            origin = self.origin.pop(key, HOST)
            self.hits[origin] += self.block_size
            transferred += origin == TRANSFER
        self.loading.update(rows)
        self.reserved.clear()
        return rows, transferred

    def load(self, row: int, block_id: int) -> None:
        """Copy a taken row up into device block `block_id`."""
        self.rows.copy_up(row, block_id)
        self.loading.discard(row)
        self.blocks_loaded += 1

    # -- reading ahead (the prefetch thread) ----------------------------------------------

    def prefetch(self, keys: list[bytes]) -> None:
        """Read the blocks of `keys` (a prompt's, past the device's hits) that the disk
        or the shared store hold, in the background, for the lookup to come."""
        if self.prefetcher is not None and keys:
            with self.lock:
                for key in keys:
                    self.unread[key] = self.unread.get(key, 0) + 1
            self.to_prefetch.put(keys)

    def _prefetched(self, key: bytes) -> tuple[memoryview | None, str]:
        """What the read-ahead got of `key`, waiting for it while it is still to read."""
        with self.arrived:
            self.arrived.wait_for(
                lambda: key in self.prefetched or key not in self.unread, READ_WAIT_S
            )
            return self.prefetched.pop(key, (None, DISK))

    def _prefetch_loop(self) -> None:
        while (keys := self.to_prefetch.get()) is not None:
            try:
                self._read_ahead(keys)
            except Exception:  # a read-ahead is only a hint: the lookup reads what is missing
                log.exception("KV tiers: reading ahead failed")
            finally:
                with self.arrived:
                    for key in keys:
                        left = self.unread.pop(key, 1) - 1
                        if left:
                            self.unread[key] = left
                    self.arrived.notify_all()
                self.to_prefetch.task_done()
        self.to_prefetch.task_done()

    def _read_ahead(self, keys: list[bytes]) -> None:
        keys = [key for key in keys if key not in self.slots]  # a racy read: only a hint
        found = 0
        if self.disk is not None:
            for key in keys:
                payload = self.disk.get(key)
                if payload is None:
                    break
                self._keep(key, payload, DISK)
                found += 1
        if self.shared is not None and found < len(keys):
            for key, payload in zip(keys[found:], self.shared.get_many(keys[found:]), strict=True):
                if payload is None:
                    break
                self._keep(key, payload, SHARED)

    def _keep(self, key: bytes, payload: memoryview, origin: str) -> None:
        with self.arrived:
            self.prefetched[key] = (payload, origin)
            self.blocks_prefetched += 1
            while len(self.prefetched) > MAX_PREFETCHED:
                self.prefetched.popitem(last=False)
            self.arrived.notify_all()

    # -- another engine's side: prefill on one worker, decode on another ----------------

    def export(self, keys: list[bytes], device_block: Callable[[bytes], int | None]) -> list[bytes]:
        """Stored records of `keys` from the first on, wherever this engine holds them
        (the device, `device_block` says where; a host row; the disk); stops at the
        first key it does not hold."""
        out = []
        for key in keys:
            block_id = device_block(key)
            if block_id is not None:
                buf, event = self.rows.snapshot(block_id)
                if event is not None:
                    event.synchronize()
                payload = buf.numpy().tobytes()
            elif key in self.slots:
                payload = self.rows.read(self.slots[key])
            else:
                payload = self.disk.get(key) if self.disk is not None else None
            if payload is None:
                break
            out.append(self.codec.encode(key, payload))
        self.blocks_exported += len(out)
        return out

    def import_records(self, keys: list[bytes], records: list[bytes]) -> int:
        """Put another engine's records of `keys` (in order) in host rows, for the
        request that asked for them to find; how many were taken. A record that is not
        a whole block of `keys` under this engine's fingerprint and secret ends the run."""
        taken = 0
        for key, record in zip(keys, records, strict=False):
            payload = self.codec.decode(record, key)
            if payload is None:
                self.import_rejected += 1
                break
            if key in self.slots:
                self.slots.move_to_end(key)
            elif not self._promote(key, payload, TRANSFER):
                break
            taken += 1
        self.blocks_imported += taken
        return taken

    # -- rows ---------------------------------------------------------------------------

    def _promote(self, key: bytes, payload: memoryview, origin: str) -> bool:
        """Put a block read from `origin` into a host row; False when none is free."""
        row = self._acquire_row()
        if row is None:
            return False
        self.rows.fill(row, payload)
        self.slots[key] = row
        self.origin[key] = origin
        return True

    def _acquire_row(self) -> int | None:
        """A free row, else the least recently used one nobody holds."""
        if self.free_rows:
            return self.free_rows.pop()
        with self.lock:
            busy = self.reserved | self.loading | self.writing
        for key, row in self.slots.items():
            if row not in busy:
                del self.slots[key]
                self.origin.pop(key, None)
                if not self._on_disk(key):
                    self._event("removed", key)
                return row
        return None

    # -- the writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self.queue.get()) is not None:
            key, row, snapshot, event = item
            try:
                if row is not None:
                    payload = self.rows.read(row)
                else:
                    if event is not None:
                        event.synchronize()
                    payload = snapshot.numpy().tobytes()
                with self.lock:
                    self.writing.discard(row)
                if self.disk is not None:
                    self.disk.put(key, payload)
                if self.shared is not None:
                    self.shared.put(key, payload)
            except Exception:  # one block lost to the tiers below; the engine goes on
                log.exception("KV tiers: writing a block down failed")
            finally:
                with self.lock:
                    self.writing.discard(row)
                    self.queued.discard(key)
                self.queue.task_done()
        self.queue.task_done()

    def flush(self) -> None:
        """Wait until every block written down so far is in the tiers below, and every
        prefetch asked for so far is done."""
        if self.writer is not None:
            self.queue.join()
            self.to_prefetch.join()

    def stop_with(self, owner: object) -> None:
        """Stop the threads once `owner` (the engine) is gone, should nobody call close():
        they hold this stack, so without it they and its host rows would outlive it."""
        if self.writer is not None:
            weakref.finalize(owner, _stop, self.queue, self.to_prefetch)

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        if self.writer is not None and self.writer.is_alive():
            self.queue.put(None)
            self.to_prefetch.put(None)
            self.writer.join()
            self.prefetcher.join()

    # -- events and stats -------------------------------------------------------------------

    def _event(self, kind: str, key: bytes) -> None:
        if self.events is not None:
            with self.lock:
                self.events.append(KVCacheEvent(kind, key, None, None, [], time.time(), "lower"))

    def take_events(self) -> list[KVCacheEvent]:
        while self.disk_dropped:
            key = self.disk_dropped.popleft()
            if key not in self.slots:
                self._event("removed", key)
        if self.events is None:
            return []
        with self.lock:
            events, self.events = self.events, []
        return events

    def stats(self) -> dict[str, int]:
        """EngineStats' kv_host_*, kv_disk_* and kv_shared_* fields."""
        out = {
            "kv_host_hits": self.hits[HOST],
            "kv_host_blocks": len(self.slots),
            "kv_host_bytes": len(self.slots) * self.rows.bytes_per_block,
            "kv_host_blocks_written": self.blocks_written,
            "kv_host_blocks_loaded": self.blocks_loaded,
            "kv_prefetched_blocks": self.blocks_prefetched,
        }
        if self.disk is not None:
            d = self.disk
            out |= {
                "kv_disk_hits": self.hits[DISK],
                "kv_disk_blocks": len(d),
                "kv_disk_bytes": d.bytes,
                "kv_disk_blocks_written": d.written,
                "kv_disk_rejected": d.rejected,
                "kv_disk_write_errors": d.write_errors,
            }
        if self.shared is not None:
            sh = self.shared
            out |= {
                "kv_shared_hits": self.hits[SHARED],
                "kv_shared_blocks_written": sh.written,
                "kv_shared_rejected": sh.rejected,
                "kv_shared_errors": sh.errors,
            }
        if self.blocks_exported or self.blocks_imported or self.import_rejected:
            out |= {
                "kv_transfer_hits": self.hits[TRANSFER],
                "kv_transfer_blocks_out": self.blocks_exported,
                "kv_transfer_blocks_in": self.blocks_imported,
                "kv_transfer_rejected": self.import_rejected,
            }
        return out


def _stop(*queues: queue.Queue) -> None:
    """The end of each thread's queue: what was put before it is still done."""
    for q in queues:
        q.put(None)
