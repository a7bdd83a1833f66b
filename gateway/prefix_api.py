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
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin_api import _admin, _principal
from gateway.auth import Principal
from gateway.backends import BackendError, BadRequestError, PrefixCachingBackend
from gateway.errors import ApiError
from gateway.http_util import json_response, parse_body
from gateway.openai_api import GW
from gateway.pins import Pin
from gateway.state import GatewayState
from gateway.tenants import Conflict, NotFound

MAX_PIN_CHARS = 200_000  # past this it cannot fit any context window we serve
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class PinCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=_NAME)
    text: str = Field(min_length=1, max_length=MAX_PIN_CHARS)
    model: str | None = Field(default=None, min_length=1)


class AdminPinCreate(PinCreate):
    tenant: str | None
    shared: bool | None = None  # default: shared exactly when there is no tenant


async def create_own_pin(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    if principal.tenant_id is None:
        raise ApiError(403, "Admin keys belong to no tenant; use POST /admin/prefixes/pins.")
    body = await parse_body(request, PinCreate)
    return await _create(gw, principal, principal.tenant_id, body)


async def create_pin(request: web.Request) -> web.Response:
    actor = await _admin(request)
    body = await parse_body(request, AdminPinCreate)
    if body.shared is not None and body.shared != (body.tenant is None):
        raise ApiError(400, "A published (shared) prefix has no tenant; a tenant's pin is "
                       "not shared. Send tenant null with shared true to publish.",
                       param="shared")  # fmt: skip
    return await _create(request.app[GW], actor, body.tenant, body)


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
    try:
        pin = await gw.pins.delete(principal.tenant_id, request.match_info["name"],
                                   principal.key_id)  # fmt: skip
    except NotFound as e:
        raise ApiError(404, str(e)) from None
    return json_response({"id": pin.id, "object": "prefix", "deleted": True})


async def delete_pin(request: web.Request) -> web.Response:
    actor = await _admin(request)
    gw = request.app[GW]
    pin = gw.pins.pins.get(request.match_info["pin_id"])
    if pin is None:
        raise ApiError(404, f"No prefix {request.match_info['pin_id']!r}.")
    await gw.pins.delete(pin.tenant_id, pin.name, actor.key_id)
    return json_response({"id": pin.id, "object": "prefix", "deleted": True})


async def report(request: web.Request) -> web.Response:
    principal = await _principal(request)
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
    return json_response({
        "object": "prefix_report",
        "prefixes": prefixes,
        "pins": pin_rows,
        "tenants": await _tenant_rows(gw, tenant_id, visible),
    })  # fmt: skip


async def _create(
    gw: GatewayState, actor: Principal, tenant_id: str | None, body: PinCreate
) -> web.Response:
    model = body.model
    if model is None:
        usable = [m for m in gw.router.cards if actor.may_use(m)]
        if len(usable) != 1:
            raise ApiError(400, f"model is required (served: {', '.join(usable) or 'none'}).",
                           param="model")  # fmt: skip
        model = usable[0]
    card = gw.router.card(model)
    if card is None:
        raise ApiError(404, f"The model `{model}` does not exist.", code="model_not_found",
                       param="model")  # fmt: skip
    if not actor.may_use(model):
        raise ApiError(403, f"Your tenant may not use the model `{model}`.",
                       code="model_not_allowed")  # fmt: skip
    if not body.text.strip():
        raise ApiError(400, "text is blank.", param="text")
    try:
        tokens = await gw.pins.tokens_of(model, body.text)
    except BadRequestError as e:
        raise ApiError(400, str(e), param="text") from None
    except BackendError as e:
        raise ApiError(503, str(e), code="backend_unavailable") from None
    if len(tokens) + 1 > card.context_length:
        raise ApiError(400, f"The prefix has {len(tokens)} tokens; the model `{model}` holds "
                       f"{card.context_length}.", code="context_length_exceeded",
                       param="text")  # fmt: skip
    try:
        pin = await gw.pins.create(tenant_id, body.name, model, body.text, actor.key_id)
    except NotFound as e:
        raise ApiError(404, str(e), param="tenant") from None
    except Conflict as e:
        raise ApiError(409, str(e), param="name") from None
    warmed = await gw.pins.prefill(pin, tokens)
    return json_response(_pin_dict(gw, pin) | {"replicas_warmed": warmed}, status=201)


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
        row = rows.setdefault(d["tenant_id"], {"tenant_id": d["tenant_id"], "requests": 0,
                                               "prompt_tokens": 0, "cached_tokens": 0})  # fmt: skip
        row["requests"] += d["requests"]
        row["prompt_tokens"] += d["prompt_tokens"]
        row["cached_tokens"] += d["cached_tokens"]
    held = gw.catalog.held_by_tenant(visible)
    for t in held:
        if t is not None:
            rows.setdefault(t, {"tenant_id": t, "requests": 0, "prompt_tokens": 0,
                                "cached_tokens": 0})  # fmt: skip
    for t, row in rows.items():
        row["name"] = names.get(t)
        row["hit_rate"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0
        row["blocks_held"], row["tokens_held"] = held.get(t, (0, 0))
    return sorted(rows.values(), key=lambda r: -r["cached_tokens"])


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/prefixes", create_own_pin)
    app.router.add_get("/v1/prefixes", list_own_pins)
    app.router.add_delete("/v1/prefixes/{name}", delete_own_pin)
    app.router.add_get("/admin/prefixes", report)
    app.router.add_post("/admin/prefixes/pins", create_pin)
    app.router.add_delete("/admin/prefixes/pins/{pin_id}", delete_pin)
