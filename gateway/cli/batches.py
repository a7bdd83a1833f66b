"""`kvgate batches list|show|cancel`: the Batch API's batches, every tenant's, straight
on the database like the other admin commands. A cancel is seen by the running
gateway's batch runner at its next turn (within a second)."""

from __future__ import annotations

import argparse
import time

from gateway.cli.output import print_rows
from gateway.db import Database
from gateway.tenancy.tenants import NotFound, TenantService


async def run(args: argparse.Namespace, service: TenantService) -> None:
    # here, not at the top: every `kvgate` command builds this module's parser, and the
    # batches' store (with the HTTP layer's errors it checks input files with) and the
    # API's shapes (pydantic) are for this command alone
    from gateway.batches import store
    from gateway.schemas.batches import batch_object

    db, cmd = service.db, args.batches_command
    if cmd == "list":
        tenant = None if args.tenant is None else await service.tenant_id_of(args.tenant)
        rows, _ = await store.page(db, tenant, None, max(1, args.limit))
        if args.json:
            print_rows([batch_object(r) for r in rows], True)
        else:
            print_rows([_row(r) for r in rows], False)
        return
    batch = await _batch(db, args.batch_id)
    if cmd == "cancel" and not await store.cancel(db, batch.id):
        raise ValueError(f"batch {batch.id} is {batch.status}: it cannot be cancelled")
    if cmd == "cancel":
        batch = await _batch(db, args.batch_id)
    print_rows(batch_object(batch) | {"tenant_id": batch.tenant_id}, args.json)


async def _batch(db: Database, batch_id: str):
    from gateway.batches import store  # (imported by `run` already)

    batch = await store.get(db, batch_id)
    if batch is None:
        raise NotFound(f"no batch {batch_id}")
    return batch


def _row(b) -> dict:
    return {
        "id": b.id,
        "tenant": b.tenant_id,
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(b.created_at)),
        "endpoint": b.endpoint,
        "status": b.status,
        "done": f"{b.completed + b.failed}/{b.total}",
        "failed": b.failed,
    }
