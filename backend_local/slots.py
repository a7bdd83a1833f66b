"""Sequences of the llama context ("slots") and the choice of one for a new request.

A slot keeps the tokens its sequence holds in the KV cells after its request ends, so the
next request with the same prefix and the same cache salt starts from there instead of
computing them again. Cells are only ever reused between requests with equal salts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend_local.requests import Request
from backend_local.text_stream import TextStream


@dataclass
class Slot:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens with KV cells in this sequence
    salt: str | None = None  # cache salt of the request that computed `cached`
    last_used: float = 0.0
    request: Request | None = None
    sampler: Any = None  # llama_sampler_p of the request
    stream: TextStream | None = None
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, its KV cell not computed yet
    reused: int = 0  # prompt tokens found cached when the request started

    @property
    def prefilling(self) -> bool:
        return self.request is not None and len(self.cached) < len(self.request.prompt)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Placement:
    slot: Slot  # the free slot that will serve the request
    source: Slot | None  # the slot whose cells hold the reusable prefix (may be `slot` itself)
    reuse: int  # prompt tokens to take from `source`


def place(slots: list[Slot], prompt: list[int], salt: str | None) -> Placement:
    """Pick a free slot for `prompt`: the longest cached prefix under the same salt wins."""
    free = [s for s in slots if s.request is None]
    assert free, "place() needs a free slot"
    source, reuse = None, 0
    for s in slots:
        if s.salt == salt and s.cached:
            n = common_prefix_len(s.cached, prompt)
            if n > reuse:
                source, reuse = s, n
    # The last prompt token is always computed again: its logits give the first output token.
    reuse = min(reuse, len(prompt) - 1)
    if reuse <= 0:
        source, reuse = None, 0
    if source is not None and source.request is None:
        return Placement(source, source, reuse)
    # Otherwise evict an empty slot if there is one, else the least recently used cache.
    target = min(free, key=lambda s: (len(s.cached) > 0, s.last_used))
    return Placement(target, source, reuse)
