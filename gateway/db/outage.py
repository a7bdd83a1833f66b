"""Which database errors mean "the database is away", as opposed to a bad statement.

A request the gateway cannot account for must not be served, and must not look like a
gateway bug either: while the database is unreachable (refused, restarting, shutting
down, a connection cut mid-statement) every route answers 503 with Retry-After, and
SQLAlchemy's pool reconnects by itself once the server is back. Anything else a
database raises stays a 500: a bug to see in the log.
"""

from __future__ import annotations

import sqlite3

import asyncpg
from sqlalchemy.exc import DBAPIError

# SQLSTATE classes: 08 connection exception, 53 insufficient resources (too many
# connections, out of memory), 57 operator intervention (shutdown, starting up)
_OUTAGE_CLASSES = ("08", "53", "57")


def is_outage(e: BaseException) -> bool:
    """True for an error that says the database cannot be reached now."""
    if isinstance(e, (ConnectionError, TimeoutError)):  # refused or timed out on connect
        return True
    if isinstance(e, asyncpg.PostgresError):  # the bare driver (Database.driver)
        return (e.sqlstate or "")[:2] in _OUTAGE_CLASSES
    if isinstance(e, asyncpg.ConnectionDoesNotExistError):
        return True
    if not isinstance(e, DBAPIError):
        return False
    if e.connection_invalidated:
        return True
    if isinstance(e.orig, sqlite3.OperationalError):  # locked past the busy timeout, I/O
        return True
    cause = e.orig.__cause__ if e.orig is not None else None
    sqlstate = getattr(e.orig, "sqlstate", None) or getattr(cause, "sqlstate", None)
    if sqlstate:
        return sqlstate[:2] in _OUTAGE_CLASSES
    # asyncpg's "connection was closed in the middle of operation" carries no SQLSTATE
    return type(cause).__name__ in ("ConnectionDoesNotExistError", "InterfaceError")
