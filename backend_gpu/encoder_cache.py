"""The vision tower's output per image, kept so that a conversation that sends the same
image again (every turn of a chat re-sends its history) does not encode it again: the
tower is the dearest part of an image's prefill, and a prefix-cache miss on the text
before an image (an edited earlier turn) would otherwise re-encode every image after it.

Bounded by image tokens (the rows it holds), least recently used out; an image larger
than the whole bound is encoded and not kept. On the model's device, in its dtype.

Tenant isolation: the key is (cache salt, image digest), not the digest alone. The
output is the same function of the pixels for every tenant, so sharing it would leak
nothing through its values, but a hit is faster than a miss: a tenant could time its own
request with a guessed image to learn whether another tenant sent that image. The prefix
cache salts its blocks for the same reason, so the encoder cache follows the same rule
rather than being the side channel around it. The cost is one encode per tenant.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

CacheKey = tuple[str | None, str]  # (cache salt, image digest)


class EncoderCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[CacheKey, torch.Tensor] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0  # images encoded

    def get(self, key: CacheKey) -> torch.Tensor | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: CacheKey, value: torch.Tensor) -> None:
        """Keep `value` [tokens, hidden] under `key`, evicting the least recently used
        until it fits; one larger than the whole bound is not kept."""
        self.misses += 1
        rows = value.shape[0]
        if rows > self.max_tokens or key in self.entries:
            return
        while self.tokens + rows > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= old.shape[0]
        self.entries[key] = value
        self.tokens += rows
