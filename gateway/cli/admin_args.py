"""The admin commands' flags (`kvgate tenants|keys|usage|audit|batches|db|prefixes`),
apart from their work (gateway.cli.admin, .audit, .batches): every `kvgate` command
builds these parsers, and the work imports the database layer (SQLAlchemy, about 0.4
CPU-s) that `kvgate serve`'s workers, `top`, `bench` and `chat` never open."""

from __future__ import annotations

import argparse
import os
from typing import Any

from gateway.tenancy.quota.limits import LIMITS, MODELS, USD

TENANT_HELP = "the tenant's id or its name"
LIFT = "none"  # a limit flag's value that lifts the limit: `kvgate keys update K --rpm none`


def add_commands(sub: argparse._SubParsersAction) -> None:
    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser("upgrade", help="migrate the database to the newest schema")

    tenants = sub.add_parser("tenants", help="create, list, update and delete tenants")
    t_sub = tenants.add_subparsers(dest="tenants_command", required=True)
    create = t_sub.add_parser("create", help="create a tenant")
    create.add_argument("name")
    _quota_args(create)
    t_sub.add_parser("list", help="list tenants")
    update = t_sub.add_parser("update", help="change a tenant's name or quotas")
    update.add_argument("tenant_id", metavar="TENANT", help=TENANT_HELP)
    update.add_argument("--name")
    _quota_args(update)
    delete = t_sub.add_parser("delete", help="delete a tenant and its keys")
    delete.add_argument("tenant_id", metavar="TENANT", help=TENANT_HELP)

    keys = sub.add_parser("keys", help="create, list, update and revoke API keys")
    k_sub = keys.add_subparsers(dest="keys_command", required=True)
    kc = k_sub.add_parser("create", help="create a key (shown once)")
    kc.add_argument(
        "tenant_id", metavar="TENANT", help=TENANT_HELP + "; 'admin': an admin key of no tenant"
    )
    kc.add_argument("--name", default="")
    kc.add_argument("--scopes", default="inference", help="comma-separated: inference,admin")
    kc.add_argument("--expires-in", type=float, help="seconds until the key expires")
    kc.add_argument("--priority", type=int, help=KEY_PRIORITY_HELP)
    _limit_args(kc, "key")
    kl = k_sub.add_parser("list", help="list keys")
    kl.add_argument("tenant_id", nargs="?", metavar="TENANT", help=TENANT_HELP)
    kl.add_argument("--tenant", dest="tenant_flag", metavar="TENANT", help="as TENANT")
    ku = k_sub.add_parser("update", help="change a key's name or limits")
    ku.add_argument("key_id")
    ku.add_argument("--name")
    ku.add_argument("--priority", type=_or_lift(int), metavar="N", help=KEY_PRIORITY_HELP)
    _limit_args(ku, "key")
    kr = k_sub.add_parser("revoke", help="revoke a key (every running gateway refuses it at once)")
    kr.add_argument("key_id")

    usage = sub.add_parser("usage", help="daily usage per tenant and model")
    usage.add_argument("--tenant", help=TENANT_HELP)
    usage.add_argument("--since", help="YYYY-MM-DD")
    usage.add_argument("--until", help="YYYY-MM-DD")
    _audit_command(sub)
    _batches_command(sub)

    prefixes = sub.add_parser(
        "prefixes", help="a running gateway's hottest cached prefixes, pins and hits per tenant"
    )
    prefixes.add_argument("--url", default="http://127.0.0.1:8000", help="default %(default)s")
    prefixes.add_argument(
        "--key",
        default=os.environ.get("KVGATE_ADMIN_KEY"),
        help="admin key (all tenants) or a tenant's key (its own); default $KVGATE_ADMIN_KEY",
    )
    prefixes.add_argument("--tenant", help="only this tenant's view (admin key): its id or name")
    prefixes.add_argument("--limit", type=int, default=20)


def _limit_args(p: argparse.ArgumentParser, whose: str) -> None:
    lift = f"; {LIFT!r}: no limit (lifts it)"
    for f in LIMITS:
        flag = "--" + f.name.replace("_", "-")
        if f.holds == USD:
            p.add_argument(flag, type=_or_lift(float), metavar="USD", help="dollars" + lift)
        elif f.holds == MODELS:
            p.add_argument(flag, help=f"comma-separated model ids the {whose} may use" + lift)
        else:
            p.add_argument(flag, type=_or_lift(int), metavar="N", help=lift[2:])


KEY_PRIORITY_HELP = (
    "the key's default priority, lower first (a background key: a larger number); it "
    "only yields, never ahead of its tenant's; `none`: the tenant's"
)


def _or_lift(cast: type) -> Any:
    """A limit's value, or None for `none` (a limit given as None is lifted)."""

    def parse(value: str) -> Any:
        return LIFTED if value.lower() == LIFT else cast(value)

    parse.__name__ = cast.__name__  # argparse's "invalid int value" names it
    return parse


LIFTED = object()  # `--rpm none`: kept apart from a flag not given (None)


def _quota_args(p: argparse.ArgumentParser) -> None:
    _limit_args(p, "tenant")
    p.add_argument("--priority", type=int)
    p.add_argument("--weight", type=float)


def _audit_command(sub: argparse._SubParsersAction) -> None:
    log = sub.add_parser("audit", help="the audit log of admin changes, newest first")
    log.add_argument("--action", help="one (key.revoke) or a family with no dot (key)")
    log.add_argument("--target", help="the id (or adapter name) of what changed")
    log.add_argument("--tenant", help="the tenant's id or its name (a deleted one: its id)")
    for flag in ("since", "until"):
        log.add_argument(f"--{flag}", help="UNIX seconds or ISO 8601 (UTC unless it says)")
    log.add_argument("--limit", type=int, default=20, help="rows per page, default 20")
    log.add_argument("--cursor", type=int, help="the next page: the cursor the last one printed")


def _batches_command(sub: argparse._SubParsersAction) -> None:
    batches = sub.add_parser("batches", help="the Batch API's batches: list, show, cancel")
    b_sub = batches.add_subparsers(dest="batches_command", required=True)
    bl = b_sub.add_parser("list", help="batches, newest first")
    bl.add_argument("--tenant", help="a tenant's id or name (default: every tenant's)")
    bl.add_argument("--limit", type=int, default=20, help="at most this many, default 20")
    bs = b_sub.add_parser("show", help="one batch: status, counts, files")
    bs.add_argument("batch_id")
    bc = b_sub.add_parser("cancel", help="cancel a batch: its lines not yet run are not")
    bc.add_argument("batch_id")
