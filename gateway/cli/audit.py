"""`kvgate audit`: the audit log of admin changes (gateway.tenancy.audit), read straight
from the database like the other admin commands, with GET /admin/audit's filters; and
who the log names for a change the command line makes."""

from __future__ import annotations

import argparse
import contextlib
import getpass
import time
from typing import Any

from gateway.cli.output import cell, print_rows
from gateway.tenancy import audit
from gateway.tenancy.tenants import NotFound, TenantService


def cli_actor() -> str:
    """Who the audit log names for a change made here: the command line works on the
    database with no admin key, so the account that ran it."""
    try:
        return f"cli:{getpass.getuser()}"[:64]
    except (OSError, KeyError):  # no user name in the environment nor in passwd
        return "cli"


async def show(args: argparse.Namespace, service: TenantService) -> None:
    tenant = args.tenant
    if tenant is not None:
        # a deleted tenant's changes stay in the log under its id
        with contextlib.suppress(NotFound):
            tenant = await service.tenant_id_of(tenant)
    # here, not at the top: every `kvgate` command builds this module's parser, and the
    # query's schema (pydantic) is for this command alone
    from pydantic import ValidationError

    from gateway.schemas.audit import AuditQuery

    flags = ("action", "target", "since", "until", "limit", "cursor")
    given = {f: getattr(args, f) for f in flags if getattr(args, f) is not None}
    try:
        query = AuditQuery.model_validate(given | ({"tenant_id": tenant} if tenant else {}))
    except ValidationError as e:
        error = e.errors()[0]
        raise ValueError(f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}") from None
    found = await audit.page(service.db, query.filter())
    if args.json:
        print_rows(found, True)
        return
    print_rows([_row(r) for r in found["data"]], False)
    if found["next_cursor"] is not None:
        print(f"\nmore: kvgate audit --cursor {found['next_cursor']} (with the same filters)")


def _row(r: dict[str, Any]) -> dict[str, Any]:
    """An audit row for people: for an update, what changed, field by field."""
    before, after = r["before"], r["after"]
    if before is None or after is None:
        change = "created" if before is None else "deleted"
    else:
        fields = [k for k in after if before.get(k) != after[k]]
        change = ", ".join(f"{k} {cell(before.get(k))} -> {cell(after[k])}" for k in fields)
    return {
        "id": r["id"],
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["ts"])),
        "actor": r["actor"],
        "action": r["action"],
        "target": r["target"],
        "tenant": r["tenant_id"],
        "change": change or "-",
    }
