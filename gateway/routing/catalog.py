"""Which replica holds which prompt blocks: the gateway's view of every prefix cache.

Backends report KV events (block stored / removed); the catalog keeps, per replica,
the blocks it holds (tenant, tokens, hits, last use). The router asks `match_tiers` how
many leading blocks of a prompt a replica already holds on its device, and how many in
it or the tiers under it (an engine's host memory and disk, KVEvent.medium "lower"): a
block there is loaded back rather than computed, so it counts, below a device hit.
A background task drains the
events about every 0.25 s and writes the changed rows to the database in one
transaction about every second (never one write per token), so the catalog and its hit
counts survive a restart.

After a restart the engines are empty: the rows loaded from the database are kept
aside as `stale`; the blocks that the pinned prefixes' prefill stores again take their
old rows back (hits kept), and the first flush (after start-up, so late events still
count) deletes the rest.

Gateways sharing one database each keep their own rows: a row's key is
"<instance>/<replica>" (the gateway's `instance` setting), so two gateways that both
run a replica "tiny-0" never write the same row, and each loads, and so drops as
stale, only its own. Within the gateway, and in its reports, a replica keeps its
backend name.

A row stands for a block its replica holds anywhere, and is deleted once it is gone from
both media; which medium holds it is kept in memory only (no column): after a restart
every row is stale until its engine reports the block again, in whichever medium, so a
stored medium would only be a guess. The reports (`chain`, `hottest`,
`held_by_tenant`) and `match` count the device's blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import func, select, text

from engine_api.records import KV_MEDIA
from gateway.backends import Backend, KVEvent, PrefixCachingBackend
from gateway.backends.capabilities import supports
from gateway.db import Database, PrefixBlock

log = logging.getLogger("kvgate.prefix")

UNKNOWN_TENANT = "?"  # a salt the gateway never handed out (it never matches a tenant)


@dataclass
class BlockEntry:
    parent_hash: str | None
    tenant_id: str | None  # None: a published prefix, shared by every tenant
    num_tokens: int
    first_seen: float
    last_used: float
    hits: int = 0
    tokens_saved: int = 0


DRAIN_EVERY_S = 0.25
FLUSH_EVERY_S = 1.0


class PrefixCatalog:
    def __init__(self, db: Database | None = None, instance: str | None = None) -> None:
        """`instance`: the gateway that owns this catalog's rows (None: the database's
        only writer, rows keyed by the plain replica name)."""
        self.db = db
        self._prefix = "" if instance is None else instance + "/"  # of this gateway's rows
        self._task: asyncio.Task | None = None
        self.replicas: dict[str, dict[str, BlockEntry]] = {}  # replica -> block hash -> entry
        # the same, for blocks in the replica's tiers under its device (the same entry
        # object where a block is in both, so its hits count once)
        self.lower: dict[str, dict[str, BlockEntry]] = {}
        self.stale: dict[str, dict[str, BlockEntry]] = {}  # loaded, not yet seen again
        self.salt_tenants: dict[str, str] = {}
        self.dirty: set[tuple[str, str]] = set()  # (replica, hash) to upsert
        self.removed: set[tuple[str, str]] = set()  # (replica, hash) to delete

    # -- tenants ---------------------------------------------------------------------

    def note_salt(self, salt: str, tenant_id: str) -> None:
        self.salt_tenants[salt] = tenant_id

    def tenant_of(self, salt: str | None) -> str | None:
        if salt is None:
            return None
        return self.salt_tenants.get(salt, UNKNOWN_TENANT)

    # -- events ----------------------------------------------------------------------

    def apply(self, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if ev.medium not in KV_MEDIA:
                raise ValueError(f"unknown KV event medium {ev.medium!r}")
            media = self.replicas if ev.medium == "device" else self.lower
            held = media.setdefault(ev.replica, {})
            key = (ev.replica, ev.block_hash)
            if ev.kind == "stored":
                held[ev.block_hash] = self._stored(ev)
                self.dirty.add(key)
                self.removed.discard(key)
            elif ev.kind == "removed":
                # the row goes once the block has left both media
                if held.pop(ev.block_hash, None) is not None and not self._find(*key):
                    self.dirty.discard(key)
                    self.removed.add(key)
            else:
                raise ValueError(f"unknown KV event kind {ev.kind!r}")

    def _stored(self, ev: KVEvent) -> BlockEntry:
        """The stored block's entry: the one it has in the other medium, or its row from
        the last run (hits kept), or a new one."""
        entry = self._find(ev.replica, ev.block_hash)
        if entry is None:
            entry = self.stale.get(ev.replica, {}).pop(ev.block_hash, None)
        if entry is None:
            entry = BlockEntry(ev.parent_hash, self._tenant(ev), ev.num_tokens, ev.at, ev.at)
        elif ev.medium == "device" and entry.tenant_id == UNKNOWN_TENANT:
            # first seen in a lower tier, whose events name no salt or parent
            entry.parent_hash, entry.tenant_id = ev.parent_hash, self._tenant(ev)
        entry.last_used = max(entry.last_used, ev.at)
        return entry

    def _tenant(self, ev: KVEvent) -> str | None:
        """The block's tenant. An engine's lower-tier events carry no salt: unknown (never
        None, which would make the block a published one)."""
        if ev.medium == "lower" and ev.cache_salt is None:
            return UNKNOWN_TENANT
        return self.tenant_of(ev.cache_salt)

    def _find(self, replica: str, block_hash: str) -> BlockEntry | None:
        """The block's entry in either medium of the replica."""
        entry = self.replicas.get(replica, {}).get(block_hash)
        return entry or self.lower.get(replica, {}).get(block_hash)

    def match(self, replica: str, hashes: list[str]) -> int:
        """How many of the leading `hashes` the replica holds on its device (a prefix
        stops at a gap)."""
        return _leading(hashes, self.replicas.get(replica, {}))

    def match_tiers(self, replica: str, hashes: list[str]) -> tuple[int, int]:
        """(anywhere, on the device): how many of the leading `hashes` the replica holds
        in its KV cache and its lower tiers taken together, and in its KV cache alone."""
        device = self.replicas.get(replica, {})
        lower = self.lower.get(replica, {})
        return _leading(hashes, device, lower), _leading(hashes, device)

    def record_hits(self, replica: str, hashes: list[str], cached_tokens: int) -> None:
        """A request on `replica` reused `cached_tokens` of its prompt: credit those blocks."""
        now = time.time()
        for h in hashes:
            entry = self._find(replica, h)
            if cached_tokens <= 0 or entry is None:
                break
            saved = min(entry.num_tokens, cached_tokens)
            entry.hits += 1
            entry.tokens_saved += saved
            entry.last_used = now
            cached_tokens -= saved
            self.dirty.add((replica, h))

    def drop_stale(self) -> None:
        """Rows loaded at start that no replica stored again (by the first flush) are gone."""
        for replica, entries in self.stale.items():
            self.removed.update((replica, h) for h in entries)
        self.stale = {}

    # -- reports ---------------------------------------------------------------------

    def chain(self, replica: str, block_hash: str) -> dict:
        """Totals of the prefix that ends at `block_hash`: blocks, tokens, tokens saved."""
        held = self.replicas[replica]
        entry = held[block_hash]
        blocks = tokens = saved = 0
        h: str | None = block_hash
        while h is not None and h in held:
            e = held[h]
            blocks, tokens, saved = blocks + 1, tokens + e.num_tokens, saved + e.tokens_saved
            h = e.parent_hash
        where = {"replica": replica, "block_hash": block_hash, "tenant_id": entry.tenant_id}
        totals = {"blocks": blocks, "tokens": tokens, "hits": entry.hits, "tokens_saved": saved}
        return where | totals | {"last_used": entry.last_used}

    def hottest(self, visible: Callable[[str | None], bool], limit: int) -> list[dict]:
        """The prefixes worth naming: a block whose hits no child block shares in full is
        where those requests' common prefix ends (a hot system prompt), and a leaf ends a
        chain; ranked by tokens saved."""
        found = []
        for replica, held in self.replicas.items():
            child_hits: dict[str, int] = {}
            for e in held.values():
                if e.parent_hash is not None:
                    child_hits[e.parent_hash] = max(child_hits.get(e.parent_hash, 0), e.hits)
            for h, e in held.items():
                if visible(e.tenant_id) and child_hits.get(h, -1) < e.hits:
                    found.append(self.chain(replica, h))
        found.sort(key=lambda r: (-r["tokens_saved"], -r["hits"], -r["tokens"]))
        return found[:limit]

    def held_by_tenant(self, visible: Callable[[str | None], bool]) -> dict[str | None, tuple]:
        """tenant -> (blocks, tokens) cached on all replicas."""
        held: dict[str | None, tuple[int, int]] = {}
        for entries in self.replicas.values():
            for e in entries.values():
                if visible(e.tenant_id):
                    blocks, tokens = held.get(e.tenant_id, (0, 0))
                    held[e.tenant_id] = (blocks + 1, tokens + e.num_tokens)
        return held

    # -- persistence -----------------------------------------------------------------

    async def load(self) -> None:
        """Read this gateway's rows from its last run. The engines start empty, so every
        row is stale until its replica stores the block again (a pin's prefill) or the
        first flush deletes it. Other gateways' rows are not read, so never dropped."""
        assert self.db is not None
        query = select(PrefixBlock)
        if self._prefix:  # an exact prefix test: LIKE is case-blind on SQLite
            n = len(self._prefix)
            query = query.where(func.substr(PrefixBlock.replica, 1, n) == self._prefix)
        async with self.db.session() as s:
            for row in (await s.scalars(query)).all():
                replica = row.replica[len(self._prefix) :]
                self.stale.setdefault(replica, {})[row.block_hash] = _entry(row)

    async def flush(self) -> None:
        """Write the changed rows and delete the removed and stale ones, in one transaction."""
        assert self.db is not None
        self.drop_stale()
        if not self.dirty and not self.removed:
            return
        dirty, removed = sorted(self.dirty), sorted(self.removed)  # sorted: one lock order
        self.dirty, self.removed = set(), set()
        rows = []
        for replica, h in dirty:
            e = self._find(replica, h)
            if e is not None:
                key = {"replica": self._prefix + replica, "block_hash": h}
                rows.append(key | dataclasses.asdict(e))
        gone = [{"replica": self._prefix + r, "block_hash": h} for r, h in removed]
        try:
            if self.db.sync_engine is not None:
                # SQLite: in a worker thread, so the write lock is never held across an
                # await (the usage writer commits on the event loop and would wait on it)
                await asyncio.to_thread(self._write_sync, gone, rows)
            else:
                async with self.db.engine.begin() as conn:
                    if gone:
                        await conn.execute(_DELETE, gone)
                    if rows:
                        await conn.execute(_UPSERT, rows)
        except Exception:  # keep them for the next flush, unless changed since
            self.dirty.update(k for k in dirty if k not in self.removed)
            self.removed.update(k for k in removed if k not in self.dirty)
            raise

    def _write_sync(self, gone: list[dict], rows: list[dict]) -> None:
        assert self.db is not None and self.db.sync_engine is not None
        with self.db.sync_engine.begin() as conn:
            if gone:
                conn.execute(_DELETE, gone)
            if rows:
                conn.execute(_UPSERT, rows)

    def start(self, backends: Callable[[], list[Backend]]) -> None:
        """Drain every prefix-caching backend's events in the background; flush to the DB."""
        self._task = asyncio.create_task(self._run(backends))

    async def stop(self) -> None:
        """The last flush, after the backends stopped. Their events are not drained: a
        stopping engine reports all its blocks removed, and the rows should outlive it
        (loaded as stale, they keep their hits for the blocks the next start stores)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    def drain(self, backends: list[Backend]) -> None:
        for b in backends:
            if supports(b, PrefixCachingBackend):
                self.apply(b.kv_events())

    async def _run(self, backends: Callable[[], list[Backend]]) -> None:
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(DRAIN_EVERY_S)
            try:
                self.drain(backends())
                if time.monotonic() - last_flush >= FLUSH_EVERY_S:
                    last_flush = time.monotonic()
                    await self.flush()
            except Exception:  # the catalog is advisory: serving goes on without it
                log.exception("prefix catalog update failed")


def _leading(hashes: list[str], *held: dict[str, BlockEntry]) -> int:
    """How many of the leading `hashes` are in one of `held` (a prefix stops at a gap)."""
    n = 0
    for h in hashes:
        if not any(h in blocks for blocks in held):
            break
        n += 1
    return n


def _entry(row: PrefixBlock) -> BlockEntry:
    return BlockEntry(
        parent_hash=row.parent_hash,
        tenant_id=row.tenant_id,
        num_tokens=row.num_tokens,
        first_seen=row.first_seen,
        last_used=row.last_used,
        hits=row.hits,
        tokens_saved=row.tokens_saved,
    )


_DELETE = text("DELETE FROM prefix_blocks WHERE replica = :replica AND block_hash = :block_hash")
_UPSERT = text(
    "INSERT INTO prefix_blocks (replica, block_hash, parent_hash, tenant_id, num_tokens, hits, "
    "tokens_saved, first_seen, last_used) VALUES (:replica, :block_hash, :parent_hash, "
    ":tenant_id, :num_tokens, :hits, :tokens_saved, :first_seen, :last_used) "
    "ON CONFLICT (replica, block_hash) DO UPDATE SET parent_hash = excluded.parent_hash, "
    "tenant_id = excluded.tenant_id, num_tokens = excluded.num_tokens, hits = excluded.hits, "
    "tokens_saved = excluded.tokens_saved, last_used = excluded.last_used"
)
