"""Ollama's model-management routes. Those that act on the models directory
(`kvgate serve --models-dir`) do so for an admin key only, a tenant's key is refused
(403), as a tenant must not add or remove models others use: /api/copy and /api/create
(a copy of a model the directory has, under a new name) link or copy its file, and
/api/delete removes the model's file; the directory is read again at once, so the model
appears or goes. /api/pull and /api/push would download or upload: kvgate reaches no
model registry, so they answer 501 with what to do instead. Errors are Ollama's
`{"error": ...}` (gateway.http.errors).
"""

from __future__ import annotations

from collections.abc import Awaitable

from aiohttp import web

from gateway.http.errors import ApiError
from gateway.http.util import json_bytes, json_response, parse_body
from gateway.ondemand import ModelsDir, of
from gateway.ondemand.files import FileError
from gateway.routes import guards
from gateway.schemas.ollama_manage import (
    OllamaCopyRequest,
    OllamaCreateRequest,
    OllamaDeleteRequest,
)
from gateway.state import GW

NDJSON = {"Content-Type": "application/x-ndjson"}
_COPY_IN = (
    "copy the model's .gguf file into the models directory of `kvgate serve --models-dir "
    "DIR`: it is served under its file's name at once"
)
NOT_IMPLEMENTED = {
    "/api/pull": f"kvgate downloads nothing: {_COPY_IN}",
    "/api/push": "kvgate uploads nothing: copy the model's .gguf file where it is wanted",
}


async def not_implemented(request: web.Request) -> web.Response:
    await request.app[GW].authenticate(request)  # a route of the API: a key, as every one
    raise ApiError(501, f"{request.path} is not implemented: {NOT_IMPLEMENTED[request.path]}.")


async def copy(request: web.Request) -> web.Response:
    await guards.admin(request)
    body = await parse_body(request, OllamaCopyRequest)
    models = _directory(request)
    await _act(models.copy(body.source.removesuffix(":latest"), _bare(body.destination)))
    return web.Response(status=200)


async def create(request: web.Request) -> web.StreamResponse:
    await guards.admin(request)
    body = await parse_body(request, OllamaCreateRequest)
    models = _directory(request)
    await _act(models.copy(body.source, _bare(body.served)))
    done = {"status": "success"}
    if body.stream:  # Ollama's progress lines: here the last one only
        return web.Response(body=json_bytes(done) + b"\n", headers=NDJSON)
    return json_response(done)


async def delete(request: web.Request) -> web.Response:
    await guards.admin(request)
    body = await parse_body(request, OllamaDeleteRequest)
    models = _directory(request)
    await _act(models.delete(body.served))
    return web.Response(status=200)


def _directory(request: web.Request) -> ModelsDir:
    """The gateway's models directory; 501 where it serves none. After the admin check
    (403 for any other key) and the body's (400), as on every route."""
    models = of(request.app[GW])
    if models is None:
        raise ApiError(
            501,
            f"{request.path} acts on a models directory, and this gateway serves none: "
            "start it with --models-dir DIR (or models_dir in the config)",
        )
    return models


def _bare(name: str) -> str:
    """A new model's name: its `:latest` tag is the model itself; another tag cannot be
    a file's name."""
    if ":" in name and not name.endswith(":latest"):
        raise ApiError(400, f"{name!r}: the models directory's models have no tags but latest")
    return name.removesuffix(":latest")


async def _act(change: Awaitable[None]) -> None:
    try:
        await change
    except FileError as e:
        raise ApiError(e.status, str(e)) from None
    except OSError as e:
        raise ApiError(500, f"the models directory could not be changed: {e.strerror}") from None


def add_routes(app: web.Application) -> None:
    for path in NOT_IMPLEMENTED:
        app.router.add_post(path, not_implemented)
    app.router.add_post("/api/copy", copy)
    app.router.add_post("/api/create", create)
    app.router.add_delete("/api/delete", delete)
