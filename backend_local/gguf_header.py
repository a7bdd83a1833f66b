"""A few string fields of a GGUF file's header, read without loading it.

The gguf package's reader builds an object for every element of every array, so a
model's vocabulary (262k strings for Gemma 3) takes it seconds; checking what a file is
(an adapter, for which architecture) needs only a few leading strings. This walks the
key/value section (GGUF v2 and v3, little-endian) and stops once it has them. The file
is not trusted: a string it reads (a key, or a value asked for) is refused past
MAX_STRING_BYTES, whatever length the file claims.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# the byte size of each fixed-size value type (uint8 ... float64; bool is one byte)
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
MAX_STRING_BYTES = 64 * 1024  # keys and the few values read are short names


def _read(f: BinaryIO, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header is cut short")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> bytes:
    n = _read(f, "<Q")
    if n > MAX_STRING_BYTES:
        raise ValueError(
            f"the GGUF header holds a string of {n} bytes (at most {MAX_STRING_BYTES})"
        )
    data = f.read(n)
    if len(data) != n:
        raise ValueError("the GGUF header is cut short")
    return data


def _skip(f: BinaryIO, kind: int) -> None:
    """Move past one value of type `kind`."""
    if kind in FIXED:
        f.seek(FIXED[kind], 1)
    elif kind == STRING:
        f.seek(_read(f, "<Q"), 1)
    elif kind == ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in FIXED:
            f.seek(FIXED[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def read_strings(path: str, keys: set[str], max_keys: int | None = None) -> dict[str, str]:
    """The string values of those of `keys` the file's header holds (among its first
    `max_keys` keys, where given: a bound on what a file that is not trusted costs to
    read); ValueError if it is not a GGUF file or its header is malformed."""
    found: dict[str, str] = {}
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise ValueError("not a GGUF file")
        version = _read(f, "<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        _read(f, "<Q")  # the tensor count
        count = _read(f, "<Q")
        for _ in range(count if max_keys is None else min(count, max_keys)):
            if len(found) == len(keys):
                break
            key = _string(f).decode("utf-8", "replace")
            kind = _read(f, "<I")
            if key in keys and kind == STRING:
                found[key] = _string(f).decode("utf-8", "replace")
            else:
                _skip(f, kind)
    return found
