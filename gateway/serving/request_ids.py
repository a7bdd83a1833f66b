"""Request ids that sort by the time they were made.

A request's id is its usage row's unique `request_id`, so each row's insert also finds
its place in that index. Random ids put every row on a different page of it; ids that
start with the time append where the last one went. On a 200,000-row SQLite database a
commit of 11 rows took 163-179 us with random ids against 87-92 us with ids that start
with the time (docs/PERF.md, issue 53), and the gap grows with the table.

An id is 48 bits of the wall clock in milliseconds, then 64 random bits: as hard to
guess within a millisecond as a 16-hex-digit secret, and it says only when the request
came, which its usage row says anyway.
"""

from __future__ import annotations

import os
import time


def time_ordered_hex() -> str:
    """28 hex digits: the millisecond (12), then 8 random bytes (16)."""
    return f"{time.time_ns() // 1_000_000:012x}{os.urandom(8).hex()}"
