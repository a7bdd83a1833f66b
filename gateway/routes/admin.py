"""The admin API under /admin/: tenants, keys, usage, backends and live stats.

Admin keys (scope `admin`, no tenant) may do everything. A tenant's own key may read
its own tenant and usage, and nothing of any other tenant.
"""

from __future__ import annotations

import asyncio
import datetime
import time

from aiohttp import web

from gateway.batches.panel import panel_batches
from gateway.http.errors import ApiError
from gateway.http.util import json_response, parse_body, sse
from gateway.observe.metrics import kv_tier_stats, kv_transfer_stats
from gateway.ondemand.shown import is_loaded, shown_stats
from gateway.routes import guards
from gateway.schemas.admin import KeyCreate, KeyUpdate, Limits, TenantCreate, TenantUpdate
from gateway.state import GW, GatewayState, with_queue
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota.limits import DAILY_SPEND, MONTHLY_SPEND
from gateway.tenancy.quota.prices import to_usd
from gateway.tenancy.tenants import Conflict, NotFound


def _own_tenant(principal: Principal, tenant_id: str) -> None:
    # 404, not 403: another tenant's ids are not even confirmed to exist.
    if not principal.is_admin and principal.tenant_id != tenant_id:
        raise ApiError(404, f"No tenant {tenant_id!r}.")


def _handle_service_errors(fn):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except NotFound as e:
            raise ApiError(404, str(e)) from None
        except Conflict as e:
            raise ApiError(409, str(e)) from None

    return wrapped


@_handle_service_errors
async def create_tenant(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    body = await parse_body(request, TenantCreate)
    fields = body.model_dump(exclude={"name"})
    tenant = await request.app[GW].tenants.create_tenant(body.name, fields, actor.key_id)
    return json_response(tenant, status=201)


@_handle_service_errors
async def list_tenants(request: web.Request) -> web.Response:
    await guards.admin(request)
    return json_response({"object": "list", "data": await request.app[GW].tenants.list_tenants()})


@_handle_service_errors
async def get_tenant(request: web.Request) -> web.Response:
    principal = await guards.principal(request)
    tenant_id = request.match_info["tenant_id"]
    _own_tenant(principal, tenant_id)
    return json_response(await request.app[GW].tenants.get_tenant(tenant_id))


@_handle_service_errors
async def update_tenant(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    body = await parse_body(request, TenantUpdate)
    gw = request.app[GW]
    tenant_id = request.match_info["tenant_id"]
    changes = body.model_dump(exclude_unset=True)
    tenant = await gw.tenants.update_tenant(tenant_id, changes, actor.key_id)
    gw.auth.forget_tenant(tenant_id)
    return json_response(tenant)


@_handle_service_errors
async def delete_tenant(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    gw = request.app[GW]
    tenant_id = request.match_info["tenant_id"]
    await gw.tenants.delete_tenant(tenant_id, actor.key_id)
    gw.auth.forget_tenant(tenant_id)
    gw.pins.forget_tenant(tenant_id)
    gw.adapters.forget_tenant(tenant_id)
    return json_response({"id": tenant_id, "object": "tenant", "deleted": True})


@_handle_service_errors
async def create_key(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    body = await parse_body(request, KeyCreate)
    expires_at = body.expires_at
    if body.expires_in_s is not None:
        expires_at = time.time() + body.expires_in_s
    if expires_at is not None and expires_at <= time.time():
        message = "expires_at is in the past: the key would never work."
        raise ApiError(400, message, param="expires_at")
    tenant_id = request.match_info["tenant_id"]
    limits = body.model_dump(include=set(Limits.model_fields))
    record, key = await request.app[GW].tenants.create_key(
        tenant_id,
        body.name,
        list(body.scopes),
        expires_at,
        actor.key_id,
        limits=limits,
        priority=body.priority,
    )
    return json_response(record | {"key": key}, status=201)


@_handle_service_errors
async def list_keys(request: web.Request) -> web.Response:
    principal = await guards.principal(request)
    tenant_id = request.match_info["tenant_id"]
    _own_tenant(principal, tenant_id)
    await request.app[GW].tenants.get_tenant(tenant_id)
    keys = await request.app[GW].tenants.list_keys(tenant_id)
    return json_response({"object": "list", "data": keys})


@_handle_service_errors
async def get_key(request: web.Request) -> web.Response:
    principal = await guards.principal(request)
    key_id = request.match_info["key_id"]
    record = await request.app[GW].tenants.get_key(key_id)
    if not principal.is_admin and record["tenant_id"] != principal.tenant_id:
        raise ApiError(404, f"No key {key_id!r}.")  # another tenant's: not even confirmed
    return json_response(record)


@_handle_service_errors
async def update_key(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    body = await parse_body(request, KeyUpdate)
    gw = request.app[GW]
    key_id = request.match_info["key_id"]
    changes = body.model_dump(exclude_unset=True)
    try:
        record = await gw.tenants.update_key(key_id, changes, actor.key_id)
    except ValueError as e:  # limits on an admin key
        raise ApiError(400, str(e)) from None
    gw.auth.forget_key(key_id)
    return json_response(record)


@_handle_service_errors
async def revoke_key(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    gw = request.app[GW]
    key_id = request.match_info["key_id"]
    record = await gw.tenants.revoke_key(key_id, actor.key_id)
    gw.auth.forget_key(key_id)
    return json_response(record)


@_handle_service_errors
async def usage(request: web.Request) -> web.Response:
    principal = await guards.principal(request)
    tenant_id = request.query.get("tenant_id")
    if not principal.is_admin:
        if tenant_id is not None and tenant_id != principal.tenant_id:
            raise ApiError(404, f"No tenant {tenant_id!r}.")
        tenant_id = principal.tenant_id
    elif tenant_id is not None:
        await request.app[GW].tenants.get_tenant(tenant_id)  # an unknown id: 404, not no usage
    since, until = _day(request, "since"), _day(request, "until")
    data = await request.app[GW].tenants.usage(tenant_id, since, until, summaries=True)
    return json_response(data)


def _day(request: web.Request, name: str) -> str | None:
    """A YYYY-MM-DD query parameter: days are compared as text, so nothing else may pass."""
    value = request.query.get(name)
    if value is None:
        return None
    try:
        day = datetime.date.fromisoformat(value)
    except ValueError:
        day = None
    if day is None or day.isoformat() != value:  # fromisoformat also takes 20240101
        raise ApiError(400, f"{name} must be a date as YYYY-MM-DD, got {value!r}.", param=name)
    return value


async def backends(request: web.Request) -> web.Response:
    await guards.admin(request)
    return json_response({"object": "list", "data": _backends(request.app[GW])})


async def stats(request: web.Request) -> web.Response:
    await guards.admin(request)
    return json_response(await snapshot(request.app[GW]))


async def stats_stream(request: web.Request) -> web.StreamResponse:
    await guards.admin(request)
    try:
        interval = max(0.1, float(request.query.get("interval", "1")))
    except ValueError:
        raise ApiError(400, "interval must be a number of seconds") from None
    gw = request.app[GW]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    try:
        while True:
            await resp.write(sse(await snapshot(gw)))
            await asyncio.sleep(interval)
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return resp


def _backends(gw: GatewayState) -> list[dict]:
    out = []
    for b in gw.backends:
        s = shown_stats(gw, b)
        broken = gw.router.broken.get(b.name)
        out.append(
            {
                "name": b.name,
                "type": gw.backend_types.get(b.name, ""),
                "healthy": s.healthy and broken is None,
                "error": broken,
                "loaded": is_loaded(s),
                "models": [m for m, bs in gw.router.serving.items() if b in bs],
                "running": s.running,
                "waiting": s.waiting,
                "kv_usage": s.kv_usage,
                "prefix_queries": s.prefix_queries,
                "prefix_hits": s.prefix_hits,
                "preemptions": s.preemptions,
                "prompt_tokens_per_s": s.prompt_tokens_per_s,
                "gen_tokens_per_s": s.gen_tokens_per_s,
                "kv_tiers": kv_tier_stats(s.extra),
                "kv_transfer": kv_transfer_stats(s.extra),
            }
        )
    return out


async def snapshot(gw: GatewayState) -> dict:
    now = time.time()
    snap = gw.traffic.snapshot(now)
    tenants = {t["id"]: t for t in await gw.tenants.list_tenants()}
    for row in snap["tenants"]:
        tenant = tenants.get(row["id"])
        if tenant is None:
            row["quota"] = None
            continue
        used = await gw.quota.used(row["id"], now)
        row["quota"] = {
            "rpm": tenant["rpm"],
            "rpm_used": used["requests"],
            "tpm": tenant["tpm"],
            "tpm_used": used["tokens"],
            "daily_tokens": tenant["daily_tokens"],
            "daily_used": used["daily"],
            "monthly_tokens": tenant["monthly_tokens"],
            "monthly_used": used["monthly"],
            # money: dollars, as the tenant's budgets are given (the counters hold nanodollars)
            "daily_spend": tenant["daily_spend"],
            "daily_spend_used": to_usd(used[DAILY_SPEND]),
            "monthly_spend": tenant["monthly_spend"],
            "monthly_spend_used": to_usd(used[MONTHLY_SPEND]),
        }
    fair = _fair_share(gw)
    for row in snap["tenants"]:
        row["fair_share"] = fair.get(row["id"])
    snap["gateway"] = {
        "url": gw.url,
        "version": "0.1.0",
        "started_at": gw.traffic.started_at,
        "uptime_s": now - gw.traffic.started_at,
    }
    snap["backends"] = _backends(gw)
    snap["batches"] = await panel_batches(gw.db)
    for row in snap["batches"]:
        tenant = tenants.get(row["tenant_id"])
        row["tenant"] = tenant["name"] if tenant is not None else None
    return snap


def _fair_share(gw: GatewayState) -> dict[str, dict]:
    """Per tenant, what the fair schedulers report (the gpu engine's, and the gateway's
    queues before other backends): service given (tokens, cached prompt tokens at a
    discount) and requests queued and running, summed over replicas."""
    out: dict[str, dict] = {}
    for b in gw.backends:
        for tenant, row in with_queue(b.stats(), gw.queues).extra.get("tenants", {}).items():
            mine = out.setdefault(tenant, {"service": 0.0, "waiting": 0, "running": 0})
            for key in mine:
                mine[key] += row[key]
    return out


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/tenants", create_tenant)
    app.router.add_get("/admin/tenants", list_tenants)
    app.router.add_get("/admin/tenants/{tenant_id}", get_tenant)
    app.router.add_patch("/admin/tenants/{tenant_id}", update_tenant)
    app.router.add_delete("/admin/tenants/{tenant_id}", delete_tenant)
    app.router.add_post("/admin/tenants/{tenant_id}/keys", create_key)
    app.router.add_get("/admin/tenants/{tenant_id}/keys", list_keys)
    app.router.add_get("/admin/keys/{key_id}", get_key)
    app.router.add_patch("/admin/keys/{key_id}", update_key)
    app.router.add_delete("/admin/keys/{key_id}", revoke_key)
    app.router.add_get("/admin/usage", usage)
    app.router.add_get("/admin/backends", backends)
    app.router.add_get("/admin/stats", stats)
    app.router.add_get("/admin/stats/stream", stats_stream)
