"""Prefix-cache keys: a full block's hash chains its parent's hash, its tokens and the
request's cache salt, so two requests share a block only when their whole prefix and
their salt agree. Blocks wholly inside a published prefix (`shared_prefix_len`) are
hashed without the salt, so every tenant shares them, on purpose.

An image's placeholder tokens are the same ids for every image of that size, so a block
holding any of them also hashes the digest of the image they stand for (`extra_keys`:
token ranges with the key their blocks take): the same picture is a hit, a different one
with the same placeholder count never is, and the salt still keeps tenants apart. A
block without such tokens hashes exactly as before.

Both engines key their prefix caches with this chain (backend_local its prefix events),
so the gateway's catalog reads one hash format whichever engine holds a block.
"""

from __future__ import annotations

import hashlib
import struct

from engine_api.errors import BadRequestError
from engine_api.records import AdapterRef

# (start, end, key): prompt tokens [start, end) whose blocks also hash `key`
KeySpan = tuple[int, int, bytes]


def hash_block(
    parent: bytes | None, token_ids: list[int], salt: str | None, extra: bytes = b""
) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if salt is not None:
        h.update(b"salt:" + salt.encode())
    if extra:
        h.update(b"extra:" + extra)
    return h.digest()


def block_extra(index: int, block_size: int, spans: list[KeySpan]) -> bytes:
    """The keys of the spans that overlap block `index`, in order (b"": none)."""
    lo, hi = index * block_size, (index + 1) * block_size
    return b"".join(key for start, end, key in spans if start < hi and end > lo)


def image_key_spans(token_ids: list[int], placeholder: int, digests: list[str]) -> list[KeySpan]:
    """The n-th run of `placeholder` tokens keyed by the n-th image's digest; a
    BadRequestError when the runs and the images do not pair up."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token != placeholder:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    if len(runs) != len(digests):
        raise BadRequestError(
            f"the prompt has {len(runs)} image placeholders for {len(digests)} images"
        )
    return [(s, e, b"image:" + d.encode()) for (s, e), d in zip(runs, digests, strict=True)]


def block_salt(index: int, block_size: int, salt: str | None, shared_prefix_len: int) -> str | None:
    """The salt block `index` is hashed with: none when it ends within the published
    prefix (shared by all tenants, on purpose), else the request's."""
    return None if (index + 1) * block_size <= shared_prefix_len else salt


def hash_blocks(
    token_ids: list[int],
    block_size: int,
    salt: str | None,
    shared_prefix_len: int = 0,
    parent: bytes | None = None,
    first_block: int = 0,
    extra_keys: list[KeySpan] | None = None,
) -> list[bytes]:
    """The chain of hashes of the full blocks of `token_ids`, starting at block
    `first_block` whose parent hash is `parent`; `extra_keys`: the images' spans."""
    hashes: list[bytes] = []
    for i in range(first_block, len(token_ids) // block_size):
        parent = hash_block(
            parent,
            token_ids[i * block_size : (i + 1) * block_size],
            block_salt(i, block_size, salt, shared_prefix_len),
            block_extra(i, block_size, extra_keys) if extra_keys else b"",
        )
        hashes.append(parent)
    return hashes


def adapter_root(adapter: AdapterRef | None) -> bytes | None:
    """The parent hash of a prompt's first block under LoRA `adapter` (None: the base
    model): a block computed under one adapter then never serves another adapter or the
    base model, published (salt-free) prefix blocks included, since the KV differs."""
    if adapter is None:
        return None
    return hashlib.sha256(
        b"lora\0" + adapter.name.encode() + b"\0" + adapter.path.encode()
    ).digest()
