"""GET /admin/audit: the audit log of admin changes (gateway.tenancy.audit), newest first,
filtered by action, target, tenant and time, a page at a time. An admin key only: the
rows tell of every tenant."""

from __future__ import annotations

from aiohttp import web
from pydantic import ValidationError

from gateway.http.errors import ApiError
from gateway.http.util import json_response
from gateway.routes import guards
from gateway.schemas.audit import AuditQuery
from gateway.state import GW
from gateway.tenancy import audit


async def list_audit(request: web.Request) -> web.Response:
    await guards.admin(request)
    try:
        query = AuditQuery.model_validate(dict(request.query))
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}", param=param) from None
    return json_response(await audit.page(request.app[GW].db, query.filter()))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/audit", list_audit)
