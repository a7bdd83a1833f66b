"""Sequences of the llama context ("slots") and the choice of one for a new request.

A slot keeps the tokens its sequence holds in the KV cells after its request ends, so the
next request with the same prefix and the same cache salt starts from there instead of
computing them again. Cells are reused between requests with different salts only within
a published prefix: tokens that both requests mark as shared (`shared_prefix_len`), and
never between requests under different LoRA adapters (or one under an adapter and one
under the base model): the adapter changes every cell. An image's cells (its placeholder
run, the same ids for every image of its size) are reused only for the same image (the
same digest) and only whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend_local.requests import Request
from backend_local.sampling import TokenLogprob
from backend_local.text_stream import TextStream
from engine_api.block_hash import KeySpan
from engine_api.records import AdapterRef


@dataclass
class Slot:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens with KV cells in this sequence
    salt: str | None = None  # cache salt of the request that computed `cached`
    last_used: float = 0.0
    request: Request | None = None
    sampler: Any = None  # llama_sampler_p of the request; None for plain greedy
    grammar: Any = None  # the request's llguidance matcher, if it has a structured output
    logit_bias: tuple[Any, Any] | None = None  # (token ids, biases) arrays of the request
    stream: TextStream | None = None
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, its KV cell not computed yet
    reused: int = 0  # prompt tokens found cached when the request started
    shared_len: int = 0  # leading tokens of `cached` that are a published prefix
    blocks: list[str] = field(default_factory=list)  # hashes of `cached`'s full blocks
    # `cached` cannot be cut shorter than this: cells restored from a saved state lack
    # the sliding-window layers' cells before the window that state ended in
    floor: int = 0
    # the disk tier: the prompt length at which to save the sequence's state (0: none)
    # and the key to save it under
    save_at: int = 0
    save_key: bytes | None = None
    # the request's prompt logprobs computed so far, until its first output carries them;
    # None when it did not ask for them
    prompt_logprobs: list[TokenLogprob | None] | None = None
    adapter: AdapterRef | None = None  # the LoRA adapter `cached` was computed under
    # the images of `cached` (and of its request's prompt beyond): placeholder runs with
    # their images' digests (engine_api.block_hash.image_key_spans)
    spans: list[KeySpan] = field(default_factory=list)

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


def same_images_len(n: int, held: list[KeySpan], wanted: list[KeySpan]) -> int:
    """`n` leading tokens cut before the first image that the two do not share whole
    within them (another image, or text where the other has an image)."""
    for span in sorted({*held, *wanted}):
        start, end, _ = span
        if start >= n:
            break
        if end > n or span not in held or span not in wanted:
            return start
    return n


def reusable_len(
    slot: Slot,
    prompt: list[int],
    salt: str | None,
    shared_prefix_len: int,
    adapter: AdapterRef | None = None,
    spans: list[KeySpan] | None = None,
) -> int:
    """Leading prompt tokens whose cells `slot` holds and the request may use: none
    under another adapter; all of a common prefix under the same salt; under another
    salt only the published prefix that both mark as shared, so a tenant's own tokens
    are never reused by another; up to the first image (`spans`, the request's) that
    the slot's cells do not hold."""
    if slot.adapter != adapter:
        return 0
    n = common_prefix_len(slot.cached, prompt)
    n = n if slot.salt == salt else min(n, slot.shared_len, shared_prefix_len)
    return same_images_len(n, slot.spans, spans or [])


def runs(seq_ids: set[int]) -> int:
    """How many runs of consecutive ids `seq_ids` makes ({0, 1, 3} makes 2)."""
    return sum(1 for i in seq_ids if i - 1 not in seq_ids)


def place(
    slots: list[Slot],
    prompt: list[int],
    salt: str | None,
    shared_prefix_len: int = 0,
    reuse_cache: bool = True,
    adapter: AdapterRef | None = None,
    spans: list[KeySpan] | None = None,
) -> Placement:
    """Pick a free slot for `prompt` and the slot holding its longest reusable prefix;
    without `reuse_cache` (a request that needs every prompt position computed, as for
    prompt logprobs) no prefix is taken."""
    free = [s for s in slots if s.request is None]
    assert free, "place() needs a free slot"
    source, reuse = None, 0
    for s in slots if reuse_cache else []:
        n = reusable_len(s, prompt, salt, shared_prefix_len, adapter, spans)
        if n > reuse and min(n, len(prompt) - 1) >= s.floor:
            source, reuse = s, n
    # The last prompt token is always computed again: its logits give the first output token.
    reuse = min(reuse, len(prompt) - 1)
    if reuse <= 0:
        source, reuse = None, 0
    in_place = source if source is not None and source.salt == salt else None
    busy = {s.seq_id for s in slots if s.request is not None}
    # llama.cpp decodes the sequences of one step in a single pass only while their ids
    # run without a gap (each gap costs a pass more), so the slot that keeps the busy ids
    # contiguous comes first. Then the one holding the prefix (no copy), then an empty
    # one, then the least recently used (another tenant's source is copied from, so its
    # own tokens stay cached for it).
    target = min(
        free,
        key=lambda s: (runs(busy | {s.seq_id}), s is not in_place, len(s.cached) > 0, s.last_used),
    )
    return Placement(target, source, reuse)
