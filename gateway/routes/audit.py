"""GET /admin/audit: the audit log of admin changes (gateway.tenancy.audit), newest first,
filtered by action, target, tenant and time, a page at a time. An admin key only: the
rows tell of every tenant."""

from __future__ import annotations

from aiohttp import web
from pydantic import ValidationError

from gateway.http.util import invalid, json_response
from gateway.routes import guards
from gateway.schemas.audit import AuditQuery
from gateway.state import GW
from gateway.tenancy import audit


async def list_audit(request: web.Request) -> web.Response:
    await guards.admin(request)
    given = dict(request.query)
    try:
        query = AuditQuery.model_validate(given)
    except ValidationError as e:
        raise invalid(e, given) from None
    return json_response(await audit.page(request.app[GW].db, query.filter()))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/audit", list_audit)
