"""A worker's LoRA adapter routes, the gateway's calls before it registers an adapter and
after it deletes one: POST /kvgate/v1/adapters/check ({name, path}: 200, or a 400 whose
message names what is wrong) and DELETE /kvgate/v1/adapters/{name}. A worker whose backend
serves no adapters answers 400 saying so."""

from __future__ import annotations

from aiohttp import web

from engine_api.errors import BackendError, BadRequestError
from engine_api.records import AdapterRef
from gateway.backends import LoraBackend
from gateway.http.errors import ApiError
from gateway.http.util import json_response, parse_body
from gateway.schemas.adapters import AdapterCheck
from gateway.worker.errors import api_error
from gateway.worker.state import WORKER

CHECK_PATH = "/kvgate/v1/adapters/check"


def _lora_backend(request: web.Request) -> LoraBackend:
    state = request.app[WORKER]
    if not isinstance(state.backend, LoraBackend):
        raise ApiError(400, f"this worker's {state.kind} backend serves no LoRA adapters")
    return state.backend


async def check_adapter(request: web.Request) -> web.Response:
    backend = _lora_backend(request)
    body = await parse_body(request, AdapterCheck)
    try:
        await backend.check_adapter(AdapterRef(body.name, body.path))
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    return json_response({"name": body.name, "ok": True})


async def remove_adapter(request: web.Request) -> web.Response:
    backend = _lora_backend(request)
    name = request.match_info["name"]
    try:
        await backend.remove_adapter(name)
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    return json_response({"name": name, "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post(CHECK_PATH, check_adapter)
    app.router.add_delete("/kvgate/v1/adapters/{name}", remove_adapter)
