"""The Files API's store: a file's bytes in the gateway's files directory (made 0700),
named by its id and never by the client's filename, its metadata in the database. Every
lookup is by tenant: another tenant's id is as unknown as one that does not exist."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path

from sqlalchemy import delete, insert, select, tuple_
from sqlalchemy.engine import make_url

from gateway.batches.writes import write
from gateway.config import Settings
from gateway.db import Database
from gateway.db.batch_tables import StoredFile

DEFAULT_DIR = "kvgate-files"


def files_dir(settings: Settings) -> Path:
    """`files_dir`, else kvgate-files beside a SQLite database's file, else in the
    working directory."""
    if settings.files_dir:
        return Path(settings.files_dir)
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(url.database).resolve().parent / DEFAULT_DIR
    return Path(DEFAULT_DIR).resolve()


class FileStore:
    def __init__(self, db: Database, root: Path) -> None:
        self.db = db
        self.root = root

    def open(self) -> None:
        """The directory, made 0700 (its files are tenants' prompts and answers)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    async def create(self, tenant_id: str, purpose: str, filename: str, data: bytes) -> StoredFile:
        file_id = "file-" + secrets.token_hex(12)
        await asyncio.to_thread(_write, self.path(file_id), data)
        values = {
            "id": file_id,
            "tenant_id": tenant_id,
            "purpose": purpose,
            "filename": filename,
            "bytes": len(data),
            "created_at": time.time(),
        }
        try:
            await write(self.db, lambda conn: conn.execute(insert(StoredFile), [values]))
        except BaseException:
            self.path(file_id).unlink(missing_ok=True)
            raise
        row = StoredFile(**values)
        return row

    async def get(self, tenant_id: str, file_id: str) -> StoredFile | None:
        async with self.db.session() as s:
            row = await s.get(StoredFile, file_id)
        return row if row is not None and row.tenant_id == tenant_id else None

    async def read(self, file_id: str) -> bytes:
        return await asyncio.to_thread(self.path(file_id).read_bytes)

    async def page(
        self, tenant_id: str, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[StoredFile], bool]:
        """Up to `limit` of the tenant's files after the file `after`, and whether more follow."""
        order = (StoredFile.created_at, StoredFile.id)
        q = select(StoredFile).where(StoredFile.tenant_id == tenant_id)
        if purpose is not None:
            q = q.where(StoredFile.purpose == purpose)
        async with self.db.session() as s:
            if after is not None and (mark := await s.get(StoredFile, after)) is not None:
                at = tuple_(*order)
                here = (mark.created_at, mark.id)
                q = q.where(at < here if newest_first else at > here)
            by = [c.desc() for c in order] if newest_first else list(order)
            rows = list((await s.scalars(q.order_by(*by).limit(limit + 1))).all())
        return rows[:limit], len(rows) > limit

    async def delete(self, tenant_id: str, file_id: str) -> bool:
        stmt = delete(StoredFile).where(StoredFile.id == file_id, StoredFile.tenant_id == tenant_id)
        gone = await write(self.db, lambda conn: conn.execute(stmt).rowcount)
        if not gone:
            return False
        self.path(file_id).unlink(missing_ok=True)
        return True


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: a crash leaves a temporary file, never a short one."""
    tmp = path.with_suffix(".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
