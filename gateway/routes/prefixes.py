"""Routes for pinned prefixes and the prefix-cache report.

OpenAI has no such routes, so they stay small (kvgate's own, documented in the README):

- `POST /v1/prefixes` {name, text, model?}, `GET /v1/prefixes`, `DELETE /v1/prefixes/{name}`:
  a tenant's own pinned system prompts (with the tenant's key).
- `POST /admin/prefixes/pins` {tenant, name, text, model, shared}: an admin pins a prompt
  for any tenant, or publishes one for every tenant (tenant null, shared true);
  `DELETE /admin/prefixes/pins/{id}`.
- `GET /admin/prefixes`: the hottest cached prefixes, the pins and per-tenant hits. A
  tenant's key sees its own rows and the published ones; the admin key sees all
  (`?tenant_id=` narrows it to one tenant's view).

A pin's prefill is work done for its tenant: a tenant's own pin is admitted through its
quota like a request (its tokens times the replicas it is prefilled on), and every
tenant's pin, an admin's too, is billed to the tenant as a usage row ("pin-<id>", the
tokens prefilled as prompt tokens, priced as input tokens of the pin's model). A tenant's
own pin whose worst case no money budget could hold is a 400, as a request's is. An
admin's pin is not refused by the tenant's rate limits, but counts in its windows and
budgets. Published pins belong to no tenant and
are not billed; neither is the prefill again at start-up (the gateway's choice).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from gateway.backends import GENERATE, BackendError, BadRequestError, PrefixCachingBackend
from gateway.http.errors import ApiError
from gateway.http.util import json_response, parse_body
from gateway.routes import guards
from gateway.routing.pins import Pin, PinCapExceeded, PinCaps
from gateway.schemas.admin import AdminPinCreate, PinCreate
from gateway.serving.model_access import require_task
from gateway.serving.token_plan import PIN_COST, check_spend
from gateway.state import GW, GatewayState
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota import QuotaExceeded, QuotaLimits, Reservation
from gateway.tenancy.tenants import Conflict, NotFound
from gateway.tenancy.usage import UsageRow, UsageUnavailable

log = logging.getLogger("kvgate.prefix")


async def create_own_pin(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    if principal.tenant_id is None:
        raise ApiError(403, "Admin keys belong to no tenant; use POST /admin/prefixes/pins.")
    body = await parse_body(request, PinCreate)
    return await _create(gw, principal, principal.tenant_id, body)


async def create_pin(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    body = await parse_body(request, AdminPinCreate)
    if body.shared is not None and body.shared != (body.tenant is None):
        message = (
            "A published (shared) prefix has no tenant; a tenant's pin is not shared. "
            "Send tenant null with shared true to publish."
        )
        raise ApiError(400, message, param="shared")
    gw = request.app[GW]
    if body.tenant is not None:
        try:  # before any quota counter is taken in an unknown tenant's name
            await gw.tenants.get_tenant(body.tenant)
        except NotFound:
            raise ApiError(404, f"No tenant {body.tenant!r}.", param="tenant") from None
    return await _create(gw, actor, body.tenant, body)


async def list_own_pins(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    pins = gw.pins.list(principal.tenant_id, everyone=principal.is_admin)
    return json_response({"object": "list", "data": [_pin_dict(gw, p) for p in pins]})


async def delete_own_pin(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    if principal.tenant_id is None:
        raise ApiError(403, "Admin keys belong to no tenant; use DELETE /admin/prefixes/pins/{id}.")
    name = request.match_info["name"]
    try:
        pin = await gw.pins.delete(principal.tenant_id, name, principal.key_id)
    except NotFound as e:
        raise ApiError(404, str(e)) from None
    return json_response({"id": pin.id, "object": "prefix", "deleted": True})


async def delete_pin(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    gw = request.app[GW]
    pin = gw.pins.pins.get(request.match_info["pin_id"])
    if pin is None:
        raise ApiError(404, f"No prefix {request.match_info['pin_id']!r}.")
    await gw.pins.delete(pin.tenant_id, pin.name, actor.key_id)
    return json_response({"id": pin.id, "object": "prefix", "deleted": True})


async def report(request: web.Request) -> web.Response:
    principal = await guards.principal(request)
    gw = request.app[GW]
    tenant_id = request.query.get("tenant_id")
    if not principal.is_admin:
        if tenant_id is not None and tenant_id != principal.tenant_id:
            raise ApiError(404, f"No tenant {tenant_id!r}.")
        tenant_id = principal.tenant_id
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise ApiError(400, "limit must be an integer", param="limit") from None
    if not 1 <= limit <= 1000:
        raise ApiError(400, "limit must be between 1 and 1000", param="limit")

    def visible(owner: str | None) -> bool:
        return tenant_id is None or owner is None or owner == tenant_id

    pins = gw.pins.list(tenant_id, everyone=tenant_id is None)
    labels = {}  # (replica, deepest block hash) -> pin name
    pin_rows = []
    for pin in pins:
        row = _pin_dict(gw, pin) | {"replicas": [], "hits": 0, "tokens_saved": 0}
        for replica, hashes in _pin_hashes(gw, pin).items():
            if hashes and gw.catalog.match(replica, hashes) == len(hashes):
                chain = gw.catalog.chain(replica, hashes[-1])
                row["replicas"].append(replica)
                row["hits"] += chain["hits"]
                row["tokens_saved"] += chain["tokens_saved"]
                labels[(replica, hashes[-1])] = pin.name
        pin_rows.append(row)
    prefixes = gw.catalog.hottest(visible, limit)
    for row in prefixes:
        row["pin"] = labels.get((row["replica"], row["block_hash"]))
    tenants = await _tenant_rows(gw, tenant_id, visible)
    return json_response(
        {"object": "prefix_report", "prefixes": prefixes, "pins": pin_rows, "tenants": tenants}
    )


async def _create(
    gw: GatewayState, actor: Principal, tenant_id: str | None, body: PinCreate
) -> web.Response:
    model = body.model
    if model is None:
        usable = [m for m in gw.router.cards if actor.may_use(m)]
        if len(usable) != 1:
            served = ", ".join(usable) or "none"
            raise ApiError(400, f"model is required (served: {served}).", param="model")
        model = usable[0]
    card = gw.router.card(model)
    if card is None:
        message = f"The model `{model}` does not exist."
        raise ApiError(404, message, code="model_not_found", param="model")
    if not actor.may_use(model):
        message = f"Your tenant may not use the model `{model}`."
        raise ApiError(403, message, code="model_not_allowed")
    require_task(gw, actor, card, GENERATE)  # an embedding model caches no prefix
    if not body.text.strip():
        raise ApiError(400, "text is blank.", param="text")
    try:
        tokens = await gw.pins.tokens_of(model, body.text)
    except BadRequestError as e:
        raise ApiError(400, str(e), param="text") from None
    except BackendError as e:
        raise ApiError(503, str(e), code="backend_unavailable") from None
    if len(tokens) + 1 > card.context_length:
        message = (
            f"The prefix has {len(tokens)} tokens; the model `{model}` holds {card.context_length}."
        )
        raise ApiError(400, message, code="context_length_exceeded", param="text")
    caps = PinCaps(gw.settings.max_pins_per_tenant, gw.settings.max_pin_tokens_per_tenant)
    prefilled = len(tokens) * len(gw.pins.replicas(model))
    reservation = await _admit(
        gw, actor, tenant_id, prefilled, gw.settings.price_of(model).input_cost(prefilled)
    )
    try:
        pin = await _store(gw, tenant_id, body, model, actor.key_id, tokens, caps)
    except BaseException:
        if reservation is not None:  # nothing was done: the request is given back too
            await gw.quota.settle(reservation, 0, count_request=False)
        raise
    # shielded: a client that goes away must not leave the quota unsettled or the pin unbilled
    warmed = await asyncio.shield(_warm_and_bill(gw, actor, pin, tokens, reservation))
    return json_response(_pin_dict(gw, pin) | {"replicas_warmed": warmed}, status=201)


async def _store(
    gw: GatewayState,
    tenant_id: str | None,
    body: PinCreate,
    model: str,
    actor: str,
    tokens: list[int],
    caps: PinCaps,
) -> Pin:
    try:
        return await gw.pins.create(tenant_id, body.name, model, body.text, actor, tokens, caps)
    except NotFound as e:
        raise ApiError(404, str(e), param="tenant") from None
    except Conflict as e:
        raise ApiError(409, str(e), param="name") from None
    except PinCapExceeded as e:
        raise ApiError(400, str(e), code="pin_limit_exceeded") from None


async def _admit(
    gw: GatewayState,
    actor: Principal,
    tenant_id: str | None,
    tokens: int,
    spend: int,
) -> Reservation | None:
    """Take the prefill and its spend (nanodollars) from the tenant's quota: refused (429)
    past a tenant key's limits, or (400) past what a money budget holds whole; an admin's
    pin is not refused but counted. A published pin has no tenant to count."""
    if tenant_id is None:
        return None
    limits = actor.limits if actor.tenant_id == tenant_id else QuotaLimits()
    check_spend(spend, limits, PIN_COST)
    try:
        return await gw.quota.admit(tenant_id, limits, tokens, time.time(), spend=spend)
    except QuotaExceeded as e:
        m = gw.metrics
        m.child(m.quota_rejections, actor.tenant_name, e.kind).inc()
        gw.traffic.rejected(tenant_id, actor.tenant_name)
        raise ApiError(429, str(e), code="rate_limit_exceeded", headers=e.headers()) from None


async def _warm_and_bill(
    gw: GatewayState,
    actor: Principal,
    pin: Pin,
    tokens: list[int],
    reservation: Reservation | None,
) -> int:
    """Prefill the pin, settle the quota with the tokens prefilled, and bill the tenant."""
    started = time.perf_counter()
    warmed = 0
    try:
        warmed = await gw.pins.prefill(pin, tokens)
    finally:
        used = len(tokens) * warmed
        spend = gw.settings.price_of(pin.model).input_cost(used)
        if reservation is not None:
            await gw.quota.settle(reservation, used, used_spend=spend)
    if pin.tenant_id is None:
        return warmed
    row = UsageRow(
        request_id=f"pin-{pin.id}",
        tenant_id=pin.tenant_id,
        key_id=actor.key_id,
        model=pin.model,
        prompt_tokens=used,
        completion_tokens=0,
        cached_tokens=0,
        ttft_ms=None,
        latency_ms=(time.perf_counter() - started) * 1000,
        status=200,
        finish_reason="pin",
        spend_nano_usd=spend,
    )
    try:
        await gw.usage.submit(row)
    except UsageUnavailable:
        # the pin is stored and warm; the recorder keeps the row and commits it later
        log.warning("pin %s: its usage row is kept for a later commit", pin.id)
    return warmed


def _pin_dict(gw: GatewayState, pin: Pin) -> dict:
    tokens = gw.pins.tokens.get(pin.id)
    return pin.public() | {"tokens": None if tokens is None else len(tokens)}


def _pin_hashes(gw: GatewayState, pin: Pin) -> dict[str, list[str]]:
    """The pin's block hashes on each replica serving its model that reports its cache."""
    tokens = gw.pins.tokens.get(pin.id)
    if tokens is None:
        return {}
    shared = len(tokens) if pin.tenant_id is None else 0
    return {
        b.name: b.block_hashes(tokens, gw.pins.salt(pin), shared)
        for b in gw.router.serving.get(pin.model, [])
        if isinstance(b, PrefixCachingBackend)
    }


async def _tenant_rows(gw: GatewayState, tenant_id: str | None, visible) -> list[dict]:
    """Prefix-cache queries (prompt tokens) and hits (cached tokens, i.e. tokens saved)."""
    usage = await gw.tenants.usage(tenant_id)
    names = {t["id"]: t["name"] for t in await gw.tenants.list_tenants()}
    rows: dict[str, dict] = {}
    for d in usage["data"]:
        row = rows.setdefault(d["tenant_id"], _no_usage(d["tenant_id"]))
        row["requests"] += d["requests"]
        row["prompt_tokens"] += d["prompt_tokens"]
        row["cached_tokens"] += d["cached_tokens"]
    held = gw.catalog.held_by_tenant(visible)
    for t in held:
        if t is not None:
            rows.setdefault(t, _no_usage(t))
    for t, row in rows.items():
        row["name"] = names.get(t)
        row["hit_rate"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0
        row["blocks_held"], row["tokens_held"] = held.get(t, (0, 0))
    return sorted(rows.values(), key=lambda r: -r["cached_tokens"])


def _no_usage(tenant_id: str) -> dict:
    return {"tenant_id": tenant_id, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/prefixes", create_own_pin)
    app.router.add_get("/v1/prefixes", list_own_pins)
    app.router.add_delete("/v1/prefixes/{name}", delete_own_pin)
    app.router.add_get("/admin/prefixes", report)
    app.router.add_post("/admin/prefixes/pins", create_pin)
    app.router.add_delete("/admin/prefixes/pins/{pin_id}", delete_pin)
