"""The LoRA adapter admin routes (an admin key): `POST /admin/adapters` {name, path,
base_model, tenant?} registers an adapter after every replica of its base model checked
it (a 400 naming the problem, and nothing stored, else); `GET /admin/adapters` lists them
all, each `ready` or `failed` (its files would not load for a request, and why); `DELETE /admin/adapters/{name}` hides one at once and unloads it from the replicas
once its requests in flight have finished. A tenant sees its adapters in /v1/models.
"""

from __future__ import annotations

from aiohttp import web

from gateway.backends import BackendError, BadRequestError
from gateway.http.errors import ApiError
from gateway.http.util import json_response, parse_body
from gateway.routes import guards
from gateway.routing.adapters import AdapterError
from gateway.schemas.adapters import AdapterCreate
from gateway.state import GW
from gateway.tenancy.tenants import NotFound


async def create_adapter(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    body = await parse_body(request, AdapterCreate)
    gw = request.app[GW]
    try:
        tenant_id = None if body.tenant is None else await gw.tenants.tenant_id_of(body.tenant)
        adapter = await gw.adapters.register(
            body.name, body.path, body.base_model, tenant_id, actor.key_id
        )
    except NotFound as e:
        raise ApiError(404, str(e)) from None
    except (AdapterError, BadRequestError) as e:
        raise ApiError(400, str(e)) from None
    except BackendError as e:
        raise ApiError(503, str(e), code="backend_unavailable") from None
    return json_response(gw.adapters.described(adapter), status=201)


async def list_adapters(request: web.Request) -> web.Response:
    await guards.admin(request)
    adapters = request.app[GW].adapters
    data = [adapters.described(a) for a in adapters.all()]
    return json_response({"object": "list", "data": data})


async def delete_adapter(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    name = request.match_info["name"]
    try:
        await request.app[GW].adapters.delete(name, actor.key_id)
    except NotFound as e:
        raise ApiError(404, str(e)) from None
    except AdapterError as e:
        raise ApiError(400, str(e)) from None
    return json_response({"name": name, "object": "adapter", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/adapters", create_adapter)
    app.router.add_get("/admin/adapters", list_adapters)
    app.router.add_delete("/admin/adapters/{name}", delete_adapter)
