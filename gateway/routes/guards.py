"""Who is calling an operator route: `principal` takes an admin key or a tenant's own
key (what a tenant may see of itself), `admin` only an admin key. Shared by the admin
and prefix routes.
"""

from __future__ import annotations

from aiohttp import web

from gateway.http.errors import ApiError
from gateway.state import GW
from gateway.tenancy.auth import Principal


async def principal(request: web.Request) -> Principal:
    gw = request.app[GW]
    try:
        return await gw.authenticate(request, scope="admin")
    except ApiError as e:
        if e.status != 403:
            raise
    return await gw.authenticate(request, scope="inference")


async def admin(request: web.Request) -> Principal:
    who = await principal(request)
    if not who.is_admin:
        raise ApiError(403, "This route needs an admin key.")
    return who
