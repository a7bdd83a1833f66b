"""`kvgate prefixes`: a running gateway's prefix catalog (it lives in the gateway's memory),
through GET /admin/prefixes. Apart from gateway.cli.admin, which builds every command's
parser: only this command imports aiohttp (about 0.25 CPU-s of a `kvgate` start)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import aiohttp

from gateway.cli.output import print_rows


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(report(args))
    except aiohttp.ClientError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 1


async def report(args: argparse.Namespace) -> int:
    """GET /admin/prefixes: the catalog lives in the running gateway's memory."""
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    url = args.url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers) as http:
        status, body = 200, {}
        if args.tenant:  # an unknown tenant is an error, not an empty report
            status, body = await _tenant_by_ref(http, url, args.tenant)
        if status == 200:
            tenant = {"tenant_id": body["id"]} if args.tenant else {}
            query = {"limit": str(args.limit)} | tenant
            async with http.get(url + "/admin/prefixes", params=query) as r:
                status, body = r.status, await r.json()
    if status != 200:
        print(f"kvgate: {status}: {body['error']['message']}", file=sys.stderr)
        return 1
    if args.json:
        print_rows(body, True)
        return 0
    now = time.time()
    names = {t["tenant_id"]: t["name"] for t in body["tenants"]}
    print("hottest prefixes")
    print_rows([_hot_prefix_row(p, now, names) for p in body["prefixes"]], False)
    print("\npinned prefixes")
    print_rows([_pin_row(p, names) for p in body["pins"]], False)
    print("\nper tenant")
    print_rows([_tenant_cache_row(t) for t in body["tenants"]], False)
    return 0


async def _tenant_by_ref(
    http: aiohttp.ClientSession, url: str, ref: str
) -> tuple[int, dict[str, Any]]:
    """GET the tenant `ref` names, by id or else by name (the admin key lists tenants)."""
    async with http.get(f"{url}/admin/tenants/{ref}") as r:
        status, body = r.status, await r.json()
    if status != 404:
        return status, body
    async with http.get(f"{url}/admin/tenants") as r:
        if r.status != 200:
            return status, body
        named = [t for t in (await r.json())["data"] if t["name"] == ref]
    return (200, named[0]) if named else (status, body)


def _tenant_label(tenant_id: str | None, names: dict[str | None, str | None]) -> str:
    """A tenant as people know it: its name (its id when the report has no name for it)."""
    if tenant_id is None:
        return "(published)"
    return names.get(tenant_id) or tenant_id


def _hot_prefix_row(p: dict, now: float, names: dict) -> dict:
    return {
        "replica": p["replica"],
        "tenant": _tenant_label(p["tenant_id"], names),
        "pin": p["pin"],
        "tokens": p["tokens"],
        "hits": p["hits"],
        "saved": p["tokens_saved"],
        "idle_s": round(now - p["last_used"], 1),
        "block": p["block_hash"][:12],
    }


def _pin_row(p: dict, names: dict) -> dict:
    return {
        "name": p["name"],
        "tenant": _tenant_label(p["tenant_id"], names),
        "model": p["model"],
        "tokens": p["tokens"],
        "replicas": p["replicas"],
        "hits": p["hits"],
        "saved": p["tokens_saved"],
    }


def _tenant_cache_row(t: dict) -> dict:
    return {
        "tenant": t["name"] or t["tenant_id"],
        "requests": t["requests"],
        "prompt_tokens": t["prompt_tokens"],
        "cached_tokens": t["cached_tokens"],
        "hit_rate": f"{t['hit_rate']:.1%}",
        "blocks_held": t["blocks_held"],
        "tokens_held": t["tokens_held"],
    }
