"""`kvgate tenants|keys|usage|audit|db`: administration straight on the database;
`kvgate prefixes` asks a running gateway (its prefix catalog lives in memory: gateway.cli.prefixes).

They work with or without a running gateway; every running gateway on the database sees
a key or tenant change (a revocation above all) within gateway.tenancy.auth.EPOCH_CHECK_S.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from gateway.batches.usage import batch_usage
from gateway.cli import audit as cli_audit
from gateway.cli import batches as cli_batches
from gateway.cli.admin_args import LIFT, LIFTED
from gateway.cli.audit import cli_actor
from gateway.cli.output import cell, print_rows
from gateway.config import Settings
from gateway.db import Database, migrate
from gateway.tenancy.quota.limits import LIMIT_FIELDS
from gateway.tenancy.quota.prices import usd_text
from gateway.tenancy.tenants import QUOTA_FIELDS, Conflict, NotFound, TenantService
from gateway.tenancy.usage_queries import USAGE_COUNTS


def _quota_values(args: argparse.Namespace, whose: str) -> dict[str, Any]:
    """The limits (and a tenant's priority and weight) given as flags, checked as the
    admin API checks them; a limit given as `none` is there as None (lifted)."""
    fields = QUOTA_FIELDS if whose == "tenant" else LIMIT_FIELDS
    values = {f: getattr(args, f) for f in fields if f != "models"}
    if args.models is not None:
        models = args.models.split(",")
        values["models"] = LIFTED if args.models.lower() == LIFT else [m for m in models if m]
    given = {f: None if v is LIFTED else v for f, v in values.items() if v is not None}
    # the admin API's bodies (pydantic) only for the commands that change limits: a
    # `kvgate` command that reads (tenants list) starts without them
    from pydantic import ValidationError

    from gateway.schemas.admin import KeyUpdate, TenantUpdate

    try:
        body = (TenantUpdate if whose == "tenant" else KeyUpdate).model_validate(given)
    except ValidationError as e:
        error = e.errors()[0]
        flag = "--" + str(error["loc"][0]).replace("_", "-")
        raise ValueError(f"{flag}: {error['msg']}") from None
    return body.model_dump(exclude_unset=True)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "prefixes":
        from gateway.cli import prefixes  # the one command here that needs aiohttp

        return prefixes.run(args)
    try:
        return asyncio.run(_run(args, settings))
    except (NotFound, Conflict, ValueError) as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    db = Database(settings.database_url, settings.database_schema, settings.sqlite_wal_limit_bytes)
    try:
        await migrate(db)
        service = TenantService(db)
        if args.command == "db":
            print(f"kvgate: database at {settings.database_url} is up to date")
        elif args.command == "tenants":
            await _tenants(args, service)
        elif args.command == "keys":
            await _keys(args, service)
        elif args.command == "usage":
            await _usage(args, service)
        elif args.command == "audit":
            await cli_audit.show(args, service)
        elif args.command == "batches":
            await cli_batches.run(args, service)
        return 0
    finally:
        await db.close()


async def _tenants(args: argparse.Namespace, service: TenantService) -> None:
    cmd = args.tenants_command
    if cmd == "create":
        quota = _quota_values(args, "tenant")
        print_rows(await service.create_tenant(args.name, quota, cli_actor()), args.json)
    elif cmd == "list":
        print_rows(await service.list_tenants(), args.json)
    elif cmd == "update":
        changes = _quota_values(args, "tenant") | ({"name": args.name} if args.name else {})
        tenant_id = await service.tenant_id_of(args.tenant_id)
        print_rows(await service.update_tenant(tenant_id, changes, cli_actor()), args.json)
    elif cmd == "delete":
        tenant_id = await service.tenant_id_of(args.tenant_id)
        await service.delete_tenant(tenant_id, cli_actor())
        if args.json:
            print_rows({"id": tenant_id, "object": "tenant", "deleted": True}, True)
        else:
            print(f"deleted tenant {args.tenant_id} ({tenant_id})")


async def _keys(args: argparse.Namespace, service: TenantService) -> None:
    cmd = args.keys_command
    if cmd == "create":
        tenant = None if args.tenant_id == "admin" else await service.tenant_id_of(args.tenant_id)
        expires = time.time() + args.expires_in if args.expires_in else None
        scopes = [s for s in args.scopes.split(",") if s]
        bad = set(scopes) - {"inference", "admin"}
        if bad:
            raise ValueError(f"unknown scopes {sorted(bad)}; use inference and/or admin")
        limits = _quota_values(args, "key")
        record, key = await service.create_key(
            tenant, args.name, scopes, expires, cli_actor(), limits=limits, priority=args.priority
        )
        if args.json:
            print_rows(record | {"key": key}, True)
        else:
            name = (await service.get_tenant(tenant))["name"] if tenant else None
            _print_new_key(record, key, name)
    elif cmd == "list":
        tenant = args.tenant_id or args.tenant_flag
        if tenant is not None:  # an unknown tenant is an error
            tenant = await service.tenant_id_of(tenant)
        print_rows(await service.list_keys(tenant), args.json)
    elif cmd == "update":
        changes = _quota_values(args, "key")
        changes |= {"name": args.name} if args.name is not None else {}
        if args.priority is not None:  # `none`: the tenant's again
            changes["priority"] = None if args.priority is LIFTED else args.priority
        print_rows(await service.update_key(args.key_id, changes, cli_actor()), args.json)
    elif cmd == "revoke":
        print_rows(await service.revoke_key(args.key_id, cli_actor()), args.json)


def _print_new_key(record: dict[str, Any], key: str, tenant_name: str | None) -> None:
    """A new key for people: whose it is, the limits it was given, and the key (once)."""
    owner = f"{tenant_name} ({record['tenant_id']})" if record["tenant_id"] else "(admin)"
    name = f" {record['name']!r}" if record["name"] else ""
    print(f"key{name} id {record['id']} for tenant {owner}")
    limits = {f: record[f] for f in LIMIT_FIELDS if record[f] is not None}
    if limits:
        print("limits: " + ", ".join(f"{f} {cell(v)}" for f, v in limits.items()))
    print(f"    {key}")
    print("This key is shown only once; store it now.")


async def _usage(args: argparse.Namespace, service: TenantService) -> None:
    tenant = args.tenant
    if tenant is not None:  # an unknown tenant is an error, not no usage
        tenant = await service.tenant_id_of(tenant)
    usage = await service.usage(tenant, args.since, args.until, summaries=True)
    usage["batches"] = await batch_usage(service.db, tenant, args.since, args.until)
    names = {t["id"]: t["name"] for t in await service.list_tenants()}
    for row in (*usage["data"], *usage["tenants"], *usage["keys"], *usage["batches"]):
        row["tenant_name"] = names.get(row["tenant_id"])  # None: the tenant was deleted
    if args.json:
        print_rows(usage, True)
        return
    rows = [{"day": r["day"]} | _usage_row(r) for r in usage["data"]]
    if rows:
        rows.append({"day": "total", "tenant": "", "model": ""} | _usage_row(usage["total"]))
    print_rows(rows, False)
    if not rows:
        return
    print("\nper tenant")
    print_rows([_usage_row(r) for r in usage["tenants"]], False)
    print("\nper key")
    print_rows(
        [{"key": r["key_id"], "name": r["name"]} | _usage_row(r) for r in usage["keys"]], False
    )
    if usage["batches"]:  # within the totals above, at the batch price
        print("\nbatch work (in the totals above)")
        print_rows([_batch_row(r) for r in usage["batches"]], False)


def _usage_row(r: dict[str, Any]) -> dict[str, Any]:
    """A usage report's row for people: the tenant's name, spend in dollars."""
    row = {}
    if "tenant_id" in r:
        row["tenant"] = r["tenant_name"] or f"{r['tenant_id']} (deleted)"
    if "model" in r:
        row["model"] = r["model"]
    counts = {c: r[c] for c in USAGE_COUNTS}
    return row | counts | {"spend_usd": usd_text(r["spend"])}


def _batch_row(r: dict[str, Any]) -> dict[str, Any]:
    tenant = r["tenant_name"] or f"{r['tenant_id']} (deleted)"
    tokens = {c: r[c] for c in ("lines", "prompt_tokens", "completion_tokens")}
    return {"batch": r["batch_id"], "tenant": tenant} | tokens | {"spend_usd": usd_text(r["spend"])}
