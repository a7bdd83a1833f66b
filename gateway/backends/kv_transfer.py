"""Prefill and decode on different workers: the roles a replica takes, what an engine
that moves KV blocks between workers offers, and the body those blocks travel in.

A prefill worker computes a long prompt's blocks; a decode worker pulls them from it
(POST /kvgate/v1/kv/export, the same GenRequest in, the blocks out) and continues from
them. The blocks are engine_api.kv_records records, each checked by the engine that
takes it (fingerprint, key, checksum), so the framing here only has to say where one
ends: each record is preceded by its length, a little-endian u32. Both ends use it.
"""

from __future__ import annotations

import struct
from typing import Protocol, runtime_checkable

from engine_api.records import GenRequest

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
FRAMED = "application/x-kvgate-kv-records"  # the export's Content-Type

_LENGTH = struct.Struct("<I")


@runtime_checkable
class KVTransferBackend(Protocol):
    """An engine that hands a prompt's blocks to another (the gpu backend)."""

    async def export_kv(self, req: GenRequest) -> list[bytes]:
        """The stored records of the leading blocks of `req`'s prompt that it holds;
        BadRequestError when it does not move blocks (not started with kv_transfer)."""
        ...

    async def import_kv(self, req: GenRequest, records: list[bytes]) -> int:
        """Take `records` for `req`'s prompt, to be used instead of computing them;
        how many blocks it took (a record that does not check out is not taken)."""
        ...


def role_of(backend: object) -> str:
    """A replica's role: a remote replica's (its options.role, else what its worker
    says); an in-process one does both."""
    role = getattr(backend, "role", BOTH)
    return role if role in ROLES else BOTH


def check_role(role: str, what: str) -> str:
    """`role` if it is one of ROLES, else ValueError naming `what` it is for."""
    if role not in ROLES:
        raise ValueError(f"{what}: role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def pack_records(records: list[bytes]) -> bytes:
    """`records` as one body: each behind its length."""
    return b"".join(_LENGTH.pack(len(r)) + r for r in records)


def unpack_records(body: bytes) -> list[bytes]:
    """The records of a body `pack_records` made; ValueError for one cut short."""
    records, at = [], 0
    view = memoryview(body)
    while at < len(body):
        if at + _LENGTH.size > len(body):
            raise ValueError("a KV records body ends inside a length")
        (size,) = _LENGTH.unpack_from(view, at)
        at += _LENGTH.size
        if at + size > len(body):
            raise ValueError("a KV records body ends inside a record")
        records.append(bytes(view[at : at + size]))
        at += size
    return records
