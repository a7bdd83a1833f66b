"""The sequences' cached tokens as prefix blocks, for a catalog outside the engine.

llama.cpp has no blocks: a sequence can reuse any prefix of its cells. A prefix catalog
(the gateway's router) keys caches by blocks, so the engine describes what its sequences
hold as full blocks of BLOCK_SIZE tokens, chain-hashed exactly as backend_gpu keys its
blocks (`engine_api.block_hash`), an image's blocks with its digest.

A block is "stored" when the first sequence comes to hold it and "removed" when the last
one lets go of it (its cells overwritten or dropped).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine_api.block_hash import KeySpan, adapter_root, block_salt, hash_blocks
from engine_api.records import AdapterRef

BLOCK_SIZE = 16


def block_hashes(
    token_ids: list[int],
    salt: str | None,
    shared_prefix_len: int = 0,
    adapter: AdapterRef | None = None,
    spans: list[KeySpan] | None = None,
) -> list[str]:
    """Hex chain hashes of the full blocks of `token_ids`, computed under `adapter`,
    with their images' digests (`spans`)."""
    root = adapter_root(adapter)
    hashes = hash_blocks(token_ids, BLOCK_SIZE, salt, shared_prefix_len, root, extra_keys=spans)
    return [h.hex() for h in hashes]


@dataclass
class BlockEvent:
    kind: str  # "stored" or "removed"
    block_hash: str
    parent_hash: str | None
    cache_salt: str | None  # the salt the block was hashed with; None: a published block
    num_tokens: int
    at: float  # time.time()


class BlockLedger:
    """How many sequences hold each block, and the events since the last `take_events`.

    Written by the worker thread only; `take_events` may run on any thread (deque appends
    and pops are atomic)."""

    def __init__(self) -> None:
        self.refs: dict[str, int] = {}
        self.events: deque[BlockEvent] = deque()

    def replace(
        self, old: list[str], new: list[str], salt: str | None, shared_prefix_len: int
    ) -> None:
        """One sequence's blocks change from `old` to `new` (hashed with `salt`)."""
        keep = 0
        while keep < min(len(old), len(new)) and old[keep] == new[keep]:
            keep += 1
        now = time.time()
        for h in old[keep:]:
            self.refs[h] -= 1
            assert self.refs[h] >= 0
            if self.refs[h] == 0:
                del self.refs[h]
                self.events.append(BlockEvent("removed", h, None, None, BLOCK_SIZE, now))
        for i in range(keep, len(new)):
            h = new[i]
            self.refs[h] = self.refs.get(h, 0) + 1
            if self.refs[h] == 1:
                parent = new[i - 1] if i else None
                salt_i = block_salt(i, BLOCK_SIZE, salt, shared_prefix_len)
                self.events.append(BlockEvent("stored", h, parent, salt_i, BLOCK_SIZE, now))

    def take_events(self) -> list[BlockEvent]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out
