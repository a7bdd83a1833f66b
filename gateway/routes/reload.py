"""POST /admin/reload: read the config file again and apply it (gateway/reload.py), as
SIGHUP does, for an operator (or a Kubernetes job) that cannot signal the process. A
refused config is a 400 naming what is wrong; nothing has changed then."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from gateway.http.errors import ApiError
from gateway.http.util import json_response
from gateway.reload import ReloadError, reload_config
from gateway.routes import guards
from gateway.state import GW


async def reload(request: web.Request) -> web.Response:
    actor = await guards.admin(request)
    try:
        done = await reload_config(request.app[GW], actor.key_id)
    except ReloadError as e:
        raise ApiError(400, str(e), code="invalid_config", param=e.field) from None
    return json_response({"reloaded": True, **dataclasses.asdict(done)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/reload", reload)
