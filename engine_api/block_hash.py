"""Prefix-cache keys: a full block's hash chains its parent's hash, its tokens and the
request's cache salt, so two requests share a block only when their whole prefix and
their salt agree. Blocks wholly inside a published prefix (`shared_prefix_len`) are
hashed without the salt, so every tenant shares them, on purpose.

Both engines key their prefix caches with this chain (backend_local its prefix events),
so the gateway's catalog reads one hash format whichever engine holds a block.
"""

from __future__ import annotations

import hashlib
import struct

from engine_api.records import AdapterRef


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if salt is not None:
        h.update(b"salt:" + salt.encode())
    return h.digest()


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
) -> list[bytes]:
    """The chain of hashes of the full blocks of `token_ids`, starting at block
    `first_block` whose parent hash is `parent`."""
    hashes: list[bytes] = []
    for i in range(first_block, len(token_ids) // block_size):
        parent = hash_block(
            parent,
            token_ids[i * block_size : (i + 1) * block_size],
            block_salt(i, block_size, salt, shared_prefix_len),
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
