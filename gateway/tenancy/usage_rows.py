"""A usage row and what writes it: its columns, the statements for SQLite and PostgreSQL,
the daily totals a batch of rows adds, and which database errors are one row's fault.
The recorder that groups and commits the rows is gateway.tenancy.usage."""

from __future__ import annotations

import functools
import operator
import sqlite3
import time
from collections import defaultdict
from dataclasses import dataclass, fields

from sqlalchemy.exc import DataError, IntegrityError

from gateway.tenancy.quota.limits import Settlement

ROW_FAULTS = (DataError, IntegrityError, sqlite3.DataError, sqlite3.IntegrityError)


@dataclass
class UsageRow:
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    latency_ms: float
    status: int
    finish_reason: str | None
    user: str | None = None
    created_at: float = 0.0
    counted_by: str = "engine"
    spend_nano_usd: int = 0  # at the model's price (gateway.tenancy.quota.prices)
    batch_id: str | None = None  # a Batch API line's batch and custom_id (gateway/batches)
    custom_id: str | None = None
    image_tokens: int = 0  # of prompt_tokens, those of its images
    # the request's quota settlement on PostgreSQL: committed with the row, not a column
    settlement: Settlement | None = None

    @property
    def day(self) -> str:
        return _utc_day(int(self.created_at // 86400))


@functools.lru_cache(maxsize=4)
def _utc_day(day: int) -> str:
    """The date of a UTC day number (each row's, once a day rather than once a row)."""
    return time.strftime("%Y-%m-%d", time.gmtime(day * 86400))


def daily_totals(rows: list[UsageRow]) -> list[dict]:
    """The rows' sums per tenant, day and model, as the daily upsert takes them."""
    totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for r in rows:
        t = totals[(r.tenant_id, r.day, r.model)]
        t[0] += 1
        t[1] += r.prompt_tokens
        t[2] += r.completion_tokens
        t[3] += r.cached_tokens
        t[4] += r.spend_nano_usd
        t[5] += r.image_tokens
    # sorted: concurrent writers (several gateways) lock daily rows in one order
    return [
        {
            "tenant_id": tenant,
            "day": day,
            "model": model,
            **dict(zip(DAILY_COUNTS, counts, strict=True)),
        }
        for (tenant, day, model), counts in sorted(totals.items())
    ]


def billed_before(row: UsageRow, e: Exception) -> bool:
    """A batch line run again after a crash whose row was committed before it: unique by
    batch and custom_id, it is billed once (gateway/batches)."""
    return row.batch_id is not None and any(
        name in str(e) for name in ("ux_usage_records_batch_line", "usage_records.batch_id")
    )


def row_fault(e: Exception) -> bool:
    """Whether the error is about one row's values, so the other rows may still commit:
    SQLSTATE class 22 (data) or 23 (integrity), from asyncpg itself or wrapped by
    SQLAlchemy as a plain DBAPIError."""
    if isinstance(e, ROW_FAULTS):
        return True
    sqlstate = getattr(e, "sqlstate", None) or getattr(getattr(e, "orig", None), "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in ("22", "23")


USAGE_COLUMNS = [f.name for f in fields(UsageRow) if f.name != "settlement"]
row_values = operator.attrgetter(*USAGE_COLUMNS)
DAILY_COUNTS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "spend_nano_usd",
    "image_tokens",
)
DAILY_COLUMNS = ("tenant_id", "day", "model", *DAILY_COUNTS)


def _insert(table: str, columns: tuple[str, ...] | list[str], marks: list[str]) -> str:
    quoted = ", ".join(f'"{c}"' for c in columns)  # `user` is a keyword in PostgreSQL
    return f"INSERT INTO {table} ({quoted}) VALUES ({', '.join(marks)})"


def _daily_upsert(marks: list[str]) -> str:
    """The same upsert on SQLite and PostgreSQL: one prepared statement, executemany."""
    added = ", ".join(f"{c} = daily_usage.{c} + excluded.{c}" for c in DAILY_COUNTS)
    return (
        _insert("daily_usage", DAILY_COLUMNS, marks)
        + f" ON CONFLICT (tenant_id, day, model) DO UPDATE SET {added}"
    )


# SQLite's cursor takes the rows' values by position (?) and the daily totals by name
# (from their dicts), asyncpg both by number
SQLITE_USAGE_INSERT = _insert("usage_records", USAGE_COLUMNS, ["?"] * len(USAGE_COLUMNS))
SQLITE_DAILY_UPSERT = _daily_upsert([":" + c for c in DAILY_COLUMNS])
PG_USAGE_INSERT = _insert(
    "usage_records", USAGE_COLUMNS, [f"${i + 1}" for i in range(len(USAGE_COLUMNS))]
)
PG_DAILY_UPSERT = _daily_upsert([f"${i + 1}" for i in range(len(DAILY_COLUMNS))])
