"""Approximate prefix routing for upstreams that report no KV events (vLLM, SGLang,
llama.cpp's servers), after SGLang's router: the gateway remembers which prompt blocks
it sent to each replica, in a bounded least-recently-used record, and hands them to the
catalog as the replica's "stored" blocks ("removed" once they fall out of the record).
The upstream's own cache may hold more or less than this; the record only has to keep
a tenant's system prompt landing on the replica that saw it last.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from engine_api.block_hash import hash_blocks
from engine_api.records import KVEvent

BLOCK_TOKENS = 16  # the record's granularity, not the upstream's block size
CAPACITY = 50_000  # blocks per replica: 800k prompt tokens


class SentBlocks:
    def __init__(self, replica: str, capacity: int = CAPACITY) -> None:
        self.replica = replica
        self.capacity = capacity
        self.blocks: OrderedDict[str, str | None] = OrderedDict()  # hash -> its salt
        self.events: list[KVEvent] = []

    @staticmethod
    def hashes(token_ids: list[int], cache_salt: str | None, shared_prefix_len: int) -> list[str]:
        return [
            h.hex() for h in hash_blocks(token_ids, BLOCK_TOKENS, cache_salt, shared_prefix_len)
        ]

    def record(self, hashes: list[str], cache_salt: str | None, shared_prefix_len: int) -> None:
        """The prompt with these full blocks went to this replica."""
        now = time.time()
        for i, h in enumerate(hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            # published blocks carry no salt (GenRequest.shared_prefix_len)
            salt = None if (i + 1) * BLOCK_TOKENS <= shared_prefix_len else cache_salt
            self.blocks[h] = salt
            parent = hashes[i - 1] if i else None
            self.events.append(KVEvent("stored", self.replica, h, parent, salt, BLOCK_TOKENS, now))
        while len(self.blocks) > self.capacity:
            h, salt = self.blocks.popitem(last=False)
            self.events.append(KVEvent("removed", self.replica, h, None, salt, BLOCK_TOKENS, now))

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
