"""A fixed pool of KV blocks with ref counts, an O(1) LRU free queue and prefix caching.

A full block's hash chains its parent's hash, its tokens and the request's cache salt
(and the digest of any image whose placeholder tokens it holds), so two requests share a
block only when their whole prefix, their images and their salt agree.
Blocks wholly inside a request's published prefix (`shared_prefix_len`) are hashed
without the salt, so every tenant shares them. Freed blocks keep their hash and stay
findable until the free queue hands them out again, oldest first (LRU eviction).

With events on, every hash that becomes findable ("stored") or stops being findable
("removed") is recorded, so a router outside the engine can mirror the cache
(vLLM's BlockStored / BlockRemoved).

With a lower tier (backend_gpu.kv_tiers), an evicted block is written down there
before its slot is reused, and admission extends the device's run of hits with blocks
the tier holds: each is loaded into a fresh device block and counts as a hit, cached
again on the device (a "stored" event). Only a contiguous prefix counts, as on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from backend_gpu.sequence import Sequence
from engine_api.block_hash import block_salt, hash_blocks


@dataclass
class KVCacheEvent:
    """kind "stored": `block_hash` became findable; "removed": it was evicted (then only
    `block_hash`, `medium` and `at` are meaningful). `medium` is where: "device" (the
    KV cache) or "lower" (the engine's own tiers below it, host memory and disk; a
    "lower" event of either kind carries only `block_hash`, `medium` and `at`: the block
    was "stored" on the device before, with the rest)."""

    kind: str
    block_hash: bytes
    parent_hash: bytes | None
    cache_salt: str | None  # the salt the block was hashed with; None: no salt (shared)
    token_ids: list[int]
    at: float
    medium: str = "device"


class LowerTier(Protocol):
    """Where evicted blocks go and come back from (kv_tiers.TierStack)."""

    def leading_hits(self, hashes: list[bytes]) -> int: ...

    def write_down(self, block_id: int, block_hash: bytes) -> None: ...

    def computed(self, block_id: int, block_hash: bytes) -> None: ...

    def take(self, hashes: list[bytes]) -> tuple[list[int], int]: ...

    def load(self, slot: int, block_id: int) -> None: ...


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop the least recently freed, remove any, O(1)."""

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)  # sentinels
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.size

    def append(self, block: Block) -> None:
        last = self.tail.prev
        assert last is not None and block.prev is None and block.next is None
        last.next, block.prev = block, last
        block.next, self.tail.prev = self.tail, block
        self.size += 1

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, "block is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        assert self.size > 0, "no free block"
        block = self.head.next
        assert block is not None
        self.remove(block)
        return block


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        enable_kv_events: bool = False,
        lower_tier: LowerTier | None = None,
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found in the cache (any tier)
        self.lower_tier = lower_tier
        # None when off: an offline user who never drains them must not pile them up
        self.events: list[KVCacheEvent] | None = [] if enable_kv_events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _pop_free(self) -> Block:
        block = self.free_queue.popleft()
        if block.hash is not None:  # evict: its old contents are about to be overwritten
            if self.cached.get(block.hash) is block:
                if self.lower_tier is not None:
                    self.lower_tier.write_down(block.block_id, block.hash)
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.append(
                        KVCacheEvent("removed", block.hash, None, None, [], time.time())
                    )
            block.hash = None
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def find_cached_blocks(self, seq: Sequence) -> list[Block]:
        """The longest run of the prompt's full blocks already in the cache.

        At least one prompt token is always left to compute, so that the step that
        finishes the prefill has logits to sample from. None for a sequence that still
        wants prompt logprobs: it must compute its prompt's positions (its blocks are
        cached for others all the same).
        """
        if not self._reads_cache(seq):
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        hits: list[Block] = []
        hashes = hash_blocks(
            seq.token_ids[: max_blocks * self.block_size],
            self.block_size,
            seq.cache_salt,
            seq.shared_prefix_len,
            seq.hash_root,
            extra_keys=seq.key_spans,
        )
        for block_hash in hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_lower_tier_hits(self, seq: Sequence, cached: list[Block]) -> list[bytes]:
        """The hashes of the prompt's blocks after the device's hits `cached` that the
        lower tier holds (contiguous, within the same bound as find_cached_blocks)."""
        if self.lower_tier is None or not self._reads_cache(seq):
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        hashes = hash_blocks(
            seq.token_ids[: max_blocks * self.block_size],
            self.block_size,
            seq.cache_salt,
            seq.shared_prefix_len,
            cached[-1].hash if cached else seq.hash_root,
            len(cached),
            seq.key_spans,
        )
        # a block the device holds again ends the run: it must not be loaded twice
        ends = next((i for i, h in enumerate(hashes) if h in self.cached), len(hashes))
        return hashes[: self.lower_tier.leading_hits(hashes[:ends])]

    def _reads_cache(self, seq: Sequence) -> bool:
        """Whether admitting `seq` looks its prompt up (and counts the query)."""
        return self.enable_prefix_caching and not seq.prompt_logprobs_pending

    def can_allocate(
        self,
        seq: Sequence,
        cached: list[Block],
        num_new_tokens: int,
        lower: list[bytes] | None = None,
    ) -> bool:
        """Whether the pool has room for `seq` with its device hits `cached`, its
        lower-tier hits `lower` (each loaded into a new block) and its first
        `num_new_tokens` tokens to compute."""
        # cached blocks with no owner sit in the free queue: taking them uses it up too
        num_revived = sum(1 for b in cached if b.ref_count == 0)
        num_tokens = (len(cached) + len(lower or ())) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(cached)
        return num_revived + num_new_blocks <= self.num_free_blocks

    def allocate(
        self, seq: Sequence, cached: list[Block], lower: list[bytes] | None = None
    ) -> None:
        """Give a waiting sequence its prefix-cache hits, the device's `cached` then the
        lower tier's `lower` (loaded back); its other blocks come from `append_slots`."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        lower = lower or []
        num_hit = len(cached) + len(lower)
        if self._reads_cache(seq):
            self.prefix_queries += len(seq)
            self.prefix_hits += num_hit * self.block_size
        for block in cached:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            assert block.hash is not None
            seq.block_hashes.append(block.hash)
        transferred = 0
        if lower:  # revived first: a device hit must not be the block a load takes
            transferred = self._load_lower(seq, lower)
        seq.num_computed_tokens = num_hit * self.block_size
        # blocks another engine computed for this very request are not cached tokens
        seq.num_cached_tokens = (num_hit - transferred) * self.block_size

    def _load_lower(self, seq: Sequence, hashes: list[bytes]) -> int:
        """Load the lower tier's blocks `hashes` into new device blocks, cached again;
        how many of them another engine computed for this request."""
        assert self.lower_tier is not None
        slots, transferred = self.lower_tier.take(hashes)  # before evictions write down
        for block_hash, slot in zip(hashes, slots, strict=True):
            block = self._pop_free()
            self.lower_tier.load(slot, block.block_id)
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
            self._register(seq, len(seq.block_hashes), block, block_hash, parent)
            seq.block_table.append(block.block_id)
            seq.block_hashes.append(block_hash)
        return transferred

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return needed - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for the KV of the next `num_new_tokens` tokens of `seq`."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._pop_free().block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks whose KV is now fully computed under their chain hash."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        new = hash_blocks(
            seq.token_ids[: seq.num_computed_tokens],
            bs,
            seq.cache_salt,
            seq.shared_prefix_len,
            parent,
            first,
            seq.key_spans,
        )
        for i, block_hash in enumerate(new, start=first):
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and block_hash not in self.cached:
                self._register(seq, i, block, block_hash, parent)
                if self.lower_tier is not None:
                    self.lower_tier.computed(block.block_id, block_hash)
            parent = block_hash

    def _register(
        self, seq: Sequence, i: int, block: Block, block_hash: bytes, parent: bytes | None
    ) -> None:
        """Make `block`, block `i` of `seq`, findable under `block_hash`."""
        bs = self.block_size
        block.hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.append(
                KVCacheEvent(
                    "stored",
                    block_hash,
                    parent,
                    block_salt(i, bs, seq.cache_salt, seq.shared_prefix_len),
                    seq.token_ids[i * bs : (i + 1) * bs],
                    time.time(),
                )
            )

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call (empty when events are off)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def free(self, seq: Sequence) -> None:
        """Drop a sequence's hold on its blocks. The tail goes to the free queue first,
        so it is evicted before the prefix that other requests are likelier to share."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
