"""GET /openapi.json: the public API's contract as an OpenAPI 3.1 document.

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
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.http.errors import is_anthropic, is_ollama
from gateway.routes import ollama_manage as manage
from gateway.schemas import embeddings as e
from gateway.schemas import messages_responses as am
from gateway.schemas import ollama as o
from gateway.schemas import ollama_manage as om
from gateway.schemas import responses as m
from gateway.schemas import responses_admin as a
from gateway.schemas import responses_api as r
from gateway.schemas import responses_api_bodies as rb
from gateway.schemas.adapters import AdapterCreate
from gateway.schemas.admin import (
    AdminPinCreate,
    KeyCreate,
    KeyUpdate,
    PinCreate,
    TenantCreate,
    TenantUpdate,
)
from gateway.schemas.base import NO_CONTROL
from gateway.schemas.batches import BatchCreate
from gateway.schemas.inference import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gateway.schemas.messages import CountTokensRequest, MessagesRequest
from gateway.state import GW

REF = "#/components/schemas/{model}"
VERSION = "0.1.0"
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    r.ResponseCreateRequest,
    PinCreate,
    AdminPinCreate,
    TenantCreate,
    TenantUpdate,
    KeyCreate,
    KeyUpdate,
    TokenizeRequest,
    DetokenizeRequest,
    e.EmbeddingRequest,
    MessagesRequest,
    CountTokensRequest,
    AdapterCreate,
    BatchCreate,
    o.OllamaChatRequest,
    o.OllamaGenerateRequest,
    o.OllamaEmbedRequest,
    o.OllamaEmbeddingsRequest,
    o.OllamaShowRequest,
    om.OllamaCopyRequest,
    om.OllamaCreateRequest,
    om.OllamaDeleteRequest,
)
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
# the Files and Batch APIs' answers: OpenAI's objects, as its client reads them
_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_BYTES = {"application/octet-stream": {"schema": {"type": "string"}}}
_OLLAMA_ERROR = {
    "application/json": {
        "schema": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "string"}},
        }
    }
}
# the statuses each kind of route answers with besides its success
AUTHED = (400, 401, 403)
LOOKUP = (*AUTHED, 404)
BODY = (408, 413, 415)  # reading the body: too slow, too large, not JSON
CREATE = (*AUTHED, *BODY, 409)
UPDATE = (*CREATE, 404)
KEY = (*LOOKUP, *BODY)
COMPLETE = (*LOOKUP, *BODY, 429, 503)
PIN = (*LOOKUP, *BODY, 409, 429, 503)
TOKENS = (*LOOKUP, *BODY, 429, 503)  # not billed, but counted against rpm
PUBLIC = (400,)  # no key needed

_SUMMARIES = {
    "post /v1/chat/completions": "Create a chat completion (OpenAI's).",
    "post /v1/completions": "Create a text completion (OpenAI's).",
    "post /v1/responses": "Create a response (OpenAI's Responses API), stateless.",
    "get /v1/models": "The models this key may use.",
    "post /tokenize": "A prompt or chat as the token ids a completion gets (vLLM's); not billed.",
    "post /detokenize": "Token ids back to text (vLLM's); not billed.",
    "post /v1/embeddings": "Embed texts or token ids with an embedding model (OpenAI's).",
    "post /v1/messages": "Create a message (Anthropic's Messages API); errors in its shape.",
    "post /v1/messages/count_tokens": "The input tokens of a Messages request; not billed.",
    "post /v1/prefixes": "Pin a system prompt for the key's tenant.",
    "get /v1/prefixes": "The tenant's pins and the published ones.",
    "delete /v1/prefixes/{name}": "Unpin one of the tenant's prefixes.",
    "get /health": "Liveness.",
    "get /ready": "Readiness: 503, with the same body, while no backend is up or it drains.",
    "get /metrics": "Prometheus metrics; the admin key (or metrics_token) if metrics_auth.",
    "get /openapi.json": "This document.",
    "post /admin/tenants": "Create a tenant.",
    "get /admin/tenants": "All tenants.",
    "get /admin/tenants/{tenant_id}": "A tenant (with a tenant's key: its own).",
    "patch /admin/tenants/{tenant_id}": "Change a tenant's name or quota.",
    "delete /admin/tenants/{tenant_id}": "Delete a tenant and its keys.",
    "post /admin/tenants/{tenant_id}/keys": "Make a key for a tenant.",
    "get /admin/tenants/{tenant_id}/keys": "A tenant's keys.",
    "get /admin/keys/{key_id}": "A key and its limits (with a tenant's key: its own).",
    "patch /admin/keys/{key_id}": "Change a key's name or limits.",
    "delete /admin/keys/{key_id}": "Revoke a key.",
    "get /admin/usage": "Daily usage per tenant and model (a tenant's key: its own).",
    "get /admin/backends": "The backends and their load.",
    "get /admin/stats": "A live stats snapshot (docs/STATS.md).",
    "get /admin/stats/stream": "Stats snapshots as server-sent events.",
    "get /admin/prefixes": "Hot cached prefixes, the pins and per-tenant hits.",
    "post /admin/prefixes/pins": "Pin a prefix for a tenant, or publish one for all.",
    "delete /admin/prefixes/pins/{pin_id}": "Unpin or unpublish a prefix.",
    "post /admin/adapters": "Register a LoRA adapter (checked by its base model's replicas).",
    "get /admin/adapters": "All LoRA adapters.",
    "delete /admin/adapters/{name}": "Delete a LoRA adapter (its requests in flight finish).",
    "post /admin/reload": "Read the config file again and apply it; 400 naming what is wrong.",
    "get /admin/audit": "The audit log of admin changes, newest first, a page at a time.",
    "post /v1/files": "Upload a file (OpenAI's Files API; multipart, purpose batch: JSONL).",
    "get /v1/files": "The tenant's files, a page at a time.",
    "get /v1/files/{file_id}": "A file's metadata.",
    "get /v1/files/{file_id}/content": "A file's bytes.",
    "delete /v1/files/{file_id}": "Delete a file.",
    "post /v1/batches": "Create a batch of an input file's lines (OpenAI's Batch API).",
    "get /v1/batches": "The tenant's batches, newest first, a page at a time.",
    "get /v1/batches/{batch_id}": "A batch: its status, counts and result files.",
    "post /v1/batches/{batch_id}/cancel": "Cancel a batch: its lines not yet run are not.",
    "get /api/version": "The Ollama API version this one follows; no key needed.",
    "get /api/tags": "The models this key may use (Ollama's).",
    "get /api/ps": "The loaded models (Ollama's): every served one; none expires.",
    "post /api/show": "A model's details, context length and capabilities (Ollama's).",
    "post /api/chat": "Chat (Ollama's): NDJSON unless stream is false.",
    "post /api/generate": "Generate from a prompt (Ollama's): NDJSON unless stream is false.",
    "post /api/embed": "Embed texts (Ollama's).",
    "post /api/embeddings": "Embed one prompt (Ollama's older route).",
    "post /api/pull": "Not implemented: copy the model's file into the models directory.",
    "post /api/push": "Not implemented: copy the model's file where it is wanted.",
    "post /api/create": "Copy a model of the models directory under a new name (admin key).",
    "post /api/copy": "Copy a model of the models directory under a new name (admin key).",
    "delete /api/delete": "Remove a model's file from the models directory (admin key).",
}
# http.middleware.refuse_control_characters answers 400 to a URL that holds a control character
_TEXT_PARAM = {"type": "string", "pattern": NO_CONTROL}
_PATH_PARAMS = {
    "tenant_id": "The tenant's id (t_...).",
    "key_id": "The key's id (key_...).",
    "pin_id": "The prefix's id (pfx_...).",
    "name": "The pin's or the LoRA adapter's name.",
    "file_id": "The file's id (file-...).",
    "batch_id": "The batch's id (batch_...).",
}
# request bodies the examples phase of a fuzzer starts from; "model" becomes a served one
_STREAM = {"stream": True, "stream_options": {"include_usage": True}}
_MESSAGES = {"messages": [{"role": "user", "content": "Say hello."}]}
_CHAT = {"model": ""} | _MESSAGES | {"max_tokens": 8}
_TEXT = {"model": "", "prompt": "Once upon a time", "max_tokens": 8}
_RESPONSE = {"model": "", "input": "Say hello.", "max_output_tokens": 8}
_ANTHROPIC = {"model": ""} | _MESSAGES
_PIN = {"name": "support", "text": "You are a helpful support agent.", "model": ""}
EXAMPLES: dict[type[BaseModel], tuple[dict[str, Any], ...]] = {
    ChatCompletionRequest: (_CHAT, _CHAT | _STREAM),
    CompletionRequest: (_TEXT, _TEXT | _STREAM),
    r.ResponseCreateRequest: (_RESPONSE, _RESPONSE | {"stream": True}),
    PinCreate: (_PIN,),
    AdminPinCreate: (_PIN | {"tenant": None, "name": "house-style", "shared": True},),
    TenantCreate: ({"name": "acme", "rpm": 600},),
    TenantUpdate: ({"rpm": 1200},),
    KeyCreate: ({"name": "ci", "scopes": ["inference"]}, {"name": "batch", "rpm": 60}),
    KeyUpdate: ({"rpm": 120, "daily_tokens": None},),
    TokenizeRequest: ({"model": "", "prompt": "Once upon a time"}, {"model": ""} | _MESSAGES),
    DetokenizeRequest: ({"model": "", "tokens": [1, 2, 3]},),
    MessagesRequest: (
        _ANTHROPIC | {"max_tokens": 8},
        _ANTHROPIC | {"max_tokens": 8, "stream": True},
    ),
    CountTokensRequest: (_ANTHROPIC | {"system": "Be brief."},),
    AdapterCreate: ({"name": "sql-lora", "path": "/srv/adapters/sql", "base_model": "base"},),
    BatchCreate: (
        {
            "input_file_id": "file-abc",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ),
    o.OllamaChatRequest: (
        _ANTHROPIC | {"stream": False},
        _ANTHROPIC | {"options": {"num_predict": 8}},
    ),
    o.OllamaGenerateRequest: ({"model": "", "prompt": "Once upon a time", "stream": False},),
    o.OllamaEmbedRequest: ({"model": "", "input": ["first", "second"]},),
    o.OllamaEmbeddingsRequest: ({"model": "", "prompt": "The food was delicious."},),
    o.OllamaShowRequest: ({"model": ""},),
    om.OllamaCopyRequest: ({"source": "smollm2", "destination": "smollm2-copy"},),
    om.OllamaCreateRequest: ({"name": "smollm2-copy", "from": "smollm2", "stream": False},),
    om.OllamaDeleteRequest: ({"name": "smollm2-copy"},),
    e.EmbeddingRequest: (
        {"model": "", "input": "The food was delicious."},
        {"model": "", "input": ["first", "second"], "encoding_format": "base64"},
    ),
}


@dataclass(frozen=True)
class Route:
    route: str  # "method /path", as in _SUMMARIES
    ok: dict[str, Any]  # media type -> the success body
    body: type[BaseModel] | None = None
    status: int = 200
    errors: tuple[int, ...] = AUTHED
    query: tuple[tuple[str, dict[str, Any], str], ...] = ()  # (name, schema, description)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _events(*models: type[BaseModel]) -> dict[str, Any]:
    """Server-sent events whose `data` is JSON of one of `models`, or `[DONE]`."""
    one = _ref(models[0]) if len(models) == 1 else {"anyOf": [_ref(x) for x in models]}
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": one},
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


def _routes() -> list[Route]:
    error = m.ErrorResponse  # a stream that fails after its 200 ends with one
    chat = _json(m.ChatCompletion) | _events(m.ChatCompletionChunk, m.ChatUsageChunk, error)
    text = _json(m.TextCompletion) | _events(m.TextCompletionChunk, m.TextUsageChunk, error)
    answer = _json(rb.ResponseObject) | _events(*rb.STREAM_EVENTS)
    reply = _json(am.MessageReply) | _events(*am.STREAM_EVENTS)
    whole = {"application/json": {"schema": {"type": "object"}}}
    return [
        Route("post /v1/chat/completions", chat, ChatCompletionRequest, errors=COMPLETE),
        Route("post /v1/completions", text, CompletionRequest, errors=COMPLETE),
        Route("post /v1/responses", answer, r.ResponseCreateRequest, errors=COMPLETE),
        Route("get /v1/models", _json(m.ModelList)),
        Route("post /tokenize", _json(m.Tokens), TokenizeRequest, errors=TOKENS),
        Route("post /detokenize", _json(m.Detokenized), DetokenizeRequest, errors=TOKENS),
        Route("post /v1/embeddings", _json(e.EmbeddingList), e.EmbeddingRequest, errors=COMPLETE),
        Route("post /v1/messages", reply, MessagesRequest, errors=COMPLETE),
        Route(
            "post /v1/messages/count_tokens",
            _json(am.MessageTokens),
            CountTokensRequest,
            errors=TOKENS,
        ),
        Route("post /v1/prefixes", _json(a.PrefixCreated), PinCreate, 201, PIN),
        Route("get /v1/prefixes", _json(a.PrefixList)),
        Route("delete /v1/prefixes/{name}", _json(a.PrefixDeleted), errors=LOOKUP),
        Route("get /health", _json(a.Health), errors=PUBLIC),
        Route("get /ready", _json(a.Readiness), errors=PUBLIC),
        Route("get /metrics", {"text/plain": {"schema": {"type": "string"}}}),
        Route("get /openapi.json", whole, errors=PUBLIC),
        *_admin_routes(),
        *_ollama_routes(),
    ]


def _ollama_routes() -> list[Route]:
    reply = _OBJECT | {"application/x-ndjson": {"schema": {"type": "string"}}}
    unmade = (*AUTHED, 501)
    return [
        Route("get /api/version", _OBJECT, errors=PUBLIC),
        Route("get /api/tags", _OBJECT),
        Route("get /api/ps", _OBJECT),
        Route("post /api/show", _OBJECT, o.OllamaShowRequest, errors=KEY),
        Route("post /api/chat", reply, o.OllamaChatRequest, errors=COMPLETE),
        Route("post /api/generate", reply, o.OllamaGenerateRequest, errors=COMPLETE),
        Route("post /api/embed", _OBJECT, o.OllamaEmbedRequest, errors=COMPLETE),
        Route("post /api/embeddings", _OBJECT, o.OllamaEmbeddingsRequest, errors=COMPLETE),
        *(Route(f"post {path}", _OBJECT, errors=unmade) for path in manage.NOT_IMPLEMENTED),
        # the models directory's, for an admin key (501: the gateway serves none)
        Route("post /api/copy", {}, om.OllamaCopyRequest, errors=(*KEY, 501)),
        Route("post /api/create", reply, om.OllamaCreateRequest, errors=(*KEY, 501)),
        Route("delete /api/delete", {}, om.OllamaDeleteRequest, errors=(*KEY, 501)),
    ]


def _admin_routes() -> list[Route]:
    day = {"type": "string", "format": "date", "pattern": NO_CONTROL}
    tenant = ("tenant_id", _TEXT_PARAM, "Only this tenant's rows.")
    usage = (tenant, ("since", day, "First day (UTC), inclusive."), ("until", day, "Last day."))
    limit = {"type": "integer", "minimum": 1, "maximum": 1000, "default": 20}
    report = (tenant, ("limit", limit, "How many prefixes."))
    interval = {"type": "number", "default": 1}
    every = (("interval", interval, "Seconds between snapshots; less than 0.1 is 0.1."),)
    return [
        Route("post /admin/tenants", _json(a.Tenant), TenantCreate, 201, CREATE),
        Route("get /admin/tenants", _json(a.TenantList)),
        Route("get /admin/tenants/{tenant_id}", _json(a.Tenant), errors=LOOKUP),
        Route("patch /admin/tenants/{tenant_id}", _json(a.Tenant), TenantUpdate, errors=UPDATE),
        Route("delete /admin/tenants/{tenant_id}", _json(a.TenantDeleted), errors=LOOKUP),
        Route("post /admin/tenants/{tenant_id}/keys", _json(a.ApiKeyCreated), KeyCreate, 201, KEY),
        Route("get /admin/tenants/{tenant_id}/keys", _json(a.ApiKeyList), errors=LOOKUP),
        Route("get /admin/keys/{key_id}", _json(a.ApiKey), errors=LOOKUP),
        Route("patch /admin/keys/{key_id}", _json(a.ApiKey), KeyUpdate, errors=KEY),
        Route("delete /admin/keys/{key_id}", _json(a.ApiKey), errors=LOOKUP),
        Route("get /admin/usage", _json(a.UsageReport), errors=LOOKUP, query=usage),
        Route("get /admin/backends", _json(a.BackendList)),
        Route("get /admin/stats", _json(a.StatsSnapshot)),
        Route("get /admin/stats/stream", _events(a.StatsSnapshot), query=every),
        Route("get /admin/prefixes", _json(a.PrefixReport), errors=LOOKUP, query=report),
        Route("post /admin/prefixes/pins", _json(a.PrefixCreated), AdminPinCreate, 201, PIN),
        Route("delete /admin/prefixes/pins/{pin_id}", _json(a.PrefixDeleted), errors=LOOKUP),
        Route("post /admin/adapters", _json(a.Adapter), AdapterCreate, 201, (*LOOKUP, *BODY, 503)),
        Route("get /admin/adapters", _json(a.AdapterList)),
        Route("delete /admin/adapters/{name}", _json(a.AdapterDeleted), errors=LOOKUP),
        Route("post /admin/reload", _json(a.Reloaded)),
        Route("get /admin/audit", _json(a.AuditList), query=_audit_query()),
        Route("post /v1/files", _OBJECT, errors=(*AUTHED, 413)),
        Route("get /v1/files", _OBJECT),
        Route("get /v1/files/{file_id}", _OBJECT, errors=LOOKUP),
        Route("get /v1/files/{file_id}/content", _BYTES, errors=LOOKUP),
        Route("delete /v1/files/{file_id}", _OBJECT, errors=LOOKUP),
        Route("post /v1/batches", _OBJECT, BatchCreate, errors=(*LOOKUP, *BODY)),
        Route("get /v1/batches", _OBJECT),
        Route("get /v1/batches/{batch_id}", _OBJECT, errors=LOOKUP),
        Route("post /v1/batches/{batch_id}/cancel", _OBJECT, errors=(*LOOKUP, 409)),
    ]


def _audit_query() -> tuple[tuple[str, dict[str, Any], str], ...]:
    when = {"type": "string", "pattern": NO_CONTROL}
    page = {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}
    cursor = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
    return (
        ("action", _TEXT_PARAM, "One action (key.revoke), or a family with no dot (key)."),
        ("target", _TEXT_PARAM, "Only changes to this id or name."),
        ("tenant_id", _TEXT_PARAM, "Only changes that concern this tenant."),
        ("since", when, "UNIX seconds or ISO 8601 (UTC unless it says), inclusive."),
        ("until", when, "UNIX seconds or ISO 8601, exclusive."),
        ("limit", page, "How many rows."),
        ("cursor", cursor, "The next_cursor of the page before."),
    )


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
        "summary": _SUMMARIES[route.route],
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
        body = _json(route.body)
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
            "schema": _TEXT_PARAM,
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
    for route in _routes():
        method, path, op = _operation(route, model)
        paths.setdefault(path, {})[method] = op
    error = {"application/json": {"schema": _ref(m.ErrorResponse)}}
    anthropic = {"application/json": {"schema": _ref(am.AnthropicError)}}
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
