"""GET /openapi.json: the public API's contract as an OpenAPI 3.1 document, assembled here
from the route table (gateway.routes.openapi_routes) and the request bodies
(gateway.routes.openapi_requests): each route's operation, its parameters and tag, and
the components every operation refers to (the schemas, the error answers, the scheme).

It is built from the pydantic models that validate the request bodies (gateway.schemas.inference,
gateway.schemas.admin, gateway.routes.prefixes) and those that describe the responses
(gateway.schemas.responses, gateway.schemas.responses_admin), so it cannot drift from what the server
accepts and sends.
tests/gateway/test_openapi.py checks that every route is in it; test_fuzz.py runs
schemathesis from it against a live gateway.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.http.errors import is_anthropic, is_ollama
from gateway.routes.openapi_requests import EXAMPLES, REQUEST_MODELS
from gateway.routes.openapi_routes import (
    PUBLIC,
    REF,
    SUMMARIES,
    TEXT_PARAM,
    Route,
    as_json,
    ref,
    route_table,
)
from gateway.schemas import embeddings as e
from gateway.schemas import messages_responses as am
from gateway.schemas import responses as m
from gateway.schemas import responses_admin as a
from gateway.schemas import responses_api_bodies as rb
from gateway.state import GW

VERSION = "0.1.0"
_ERRORS = {
    400: "The request is malformed or breaks a rule (the body, a parameter, the URL).",
    401: "No API key, or an unknown, revoked or expired one.",
    403: "The key may not do this (scope, tenant, model).",
    404: "No such model, tenant, key or prefix (another tenant's ids included).",
    408: "The body did not arrive in time.",
    409: "The name is taken.",
    413: "The body is larger than the server's limit.",
    415: "The body is not JSON (Content-Type), or its Content-Encoding is not gzip or deflate.",
    429: "A quota (the tenant's or the key's) is exhausted; the message says whose, the "
    "x-ratelimit-* headers which.",
    501: "Not implemented: the message says what to do instead.",
    503: "No backend could serve it, or its usage could not be recorded.",
}
_OLLAMA_ERROR = {
    "application/json": {
        "schema": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "string"}},
        }
    }
}
_PATH_PARAMS = {
    "tenant_id": "The tenant's id (t_...).",
    "key_id": "The key's id (key_...).",
    "pin_id": "The prefix's id (pfx_...).",
    "name": "The pin's or the LoRA adapter's name.",
    "file_id": "The file's id (file-...).",
    "batch_id": "The batch's id (batch_...).",
}


def _response_models() -> list[type[BaseModel]]:
    """Every response model defined in api_models, api_models_admin and the embeddings'
    schemas (nested ones come along by $ref anyway); one module's imports from another
    are not counted twice."""
    return [
        v
        for module in (m, a, e, rb, am)
        for v in vars(module).values()
        if isinstance(v, type)
        and issubclass(v, m.Body)
        and v is not m.Body
        and v.__module__ == module.__name__
    ]


def _schemas() -> dict[str, Any]:
    models = [(x, "validation") for x in REQUEST_MODELS]
    models += [(x, "serialization") for x in _response_models()]
    _, defs = models_json_schema(models, ref_template=REF)
    return defs["$defs"]


def _operation(route: Route, model: str) -> tuple[str, str, dict[str, Any]]:
    method, path = route.route.split(" ")
    responses = {str(route.status): {"description": "Success.", "content": route.ok}}
    if path == "/ready":  # not ready is no error: the same body, with ready false
        responses["503"] = {"description": "Not ready.", "content": route.ok}
    for code in route.errors:  # Anthropic's routes: its shape, and 529 for a 503
        shape, code = ("A", 529 if code == 503 else code) if is_anthropic(path) else ("E", code)
        shape = "O" if is_ollama(path) else shape
        responses[str(code)] = {"$ref": f"#/components/responses/{shape}{code}"}
    op: dict[str, Any] = {
        "operationId": method + re.sub(r"[^A-Za-z0-9]+", "_", path).rstrip("_"),
        "summary": SUMMARIES[route.route],
        "tags": [_tag(path)],
        "responses": responses,
    }
    if route.errors == PUBLIC:
        op["security"] = []
    elif path == "/metrics":  # a key only when the gateway runs with metrics_auth
        op["security"] = [{}, {"bearerAuth": []}]
    params = _parameters(path, route.query)
    if params:
        op["parameters"] = params
    if route.body is not None:
        body = as_json(route.body)
        body["application/json"]["examples"] = {
            f"example{i}": {"value": ex | ({"model": model} if "model" in ex else {})}
            for i, ex in enumerate(EXAMPLES[route.body])
        }
        op["requestBody"] = {"required": True, "content": body}
    return method, path, op


def _parameters(path: str, query: tuple) -> list[dict[str, Any]]:
    params = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": TEXT_PARAM,
            "description": _PATH_PARAMS[name],
        }
        for name in re.findall(r"{(\w+)}", path)
    ]
    for name, schema, text in query:
        params.append({"name": name, "in": "query", "schema": schema, "description": text})
    return params


def _tag(path: str) -> str:
    if "prefixes" in path:
        return "prefixes"
    if path.startswith("/admin/"):
        return "admin"
    if is_anthropic(path):
        return "anthropic"
    if is_ollama(path):
        return "ollama"
    return "openai" if path.startswith("/v1/") or path.endswith("tokenize") else "health"


def build_document(model: str = "MODEL") -> dict[str, Any]:
    """The document; `model` (one the gateway serves) goes into the request examples."""
    paths: dict[str, dict[str, Any]] = {}
    for route in route_table():
        method, path, op = _operation(route, model)
        paths.setdefault(path, {})[method] = op
    error = {"application/json": {"schema": ref(m.ErrorResponse)}}
    anthropic = {"application/json": {"schema": ref(am.AnthropicError)}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvgate",
            "version": VERSION,
            "description": "A multi-tenant, OpenAI-compatible LLM gateway. Every error "
            "is OpenAI's error object; on /v1/messages, Anthropic's; on /api, Ollama's.",
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "responses": {
                f"E{code}": {"description": text, "content": error}
                for code, text in _ERRORS.items()
            }
            | {
                f"A{529 if code == 503 else code}": {"description": text, "content": anthropic}
                for code, text in _ERRORS.items()
            }
            | {
                f"O{code}": {"description": text, "content": _OLLAMA_ERROR}
                for code, text in _ERRORS.items()
            },
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer", "description": "A kvg- key."}
            },
        },
        "security": [{"bearerAuth": []}],
    }


def add_routes(app: web.Application) -> None:
    """GET /openapi.json, no key needed. Built on the first request, when the served
    models are known, from the pydantic models as they are; the same bytes after that."""
    built: list[bytes] = []

    async def openapi_json(request: web.Request) -> web.Response:
        if not built:
            model = next(iter(request.app[GW].router.cards), "MODEL")
            built.append(json.dumps(build_document(model)).encode())
        return web.Response(body=built[0], content_type="application/json")

    app.router.add_get("/openapi.json", openapi_json)
