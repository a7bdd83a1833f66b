"""The route table of the OpenAPI document (gateway.routes.openapi): every route the
gateway serves, what it answers on success (a model's JSON, its server-sent events,
NDJSON, bytes), the body it takes, the error statuses it may answer with, its query
parameters and its one-line summary. Apart from the document's assembly so that adding a
route is one line here, and the assembly (operations, parameters, components) reads the
same for every route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

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

REF = "#/components/schemas/{model}"
# the Files and Batch APIs' answers: OpenAI's objects, as its client reads them
_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_BYTES = {"application/octet-stream": {"schema": {"type": "string"}}}
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

SUMMARIES = {
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
TEXT_PARAM = {"type": "string", "pattern": NO_CONTROL}


@dataclass(frozen=True)
class Route:
    route: str  # "method /path", as in SUMMARIES
    ok: dict[str, Any]  # media type -> the success body
    body: type[BaseModel] | None = None
    status: int = 200
    errors: tuple[int, ...] = AUTHED
    query: tuple[tuple[str, dict[str, Any], str], ...] = ()  # (name, schema, description)


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def as_json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": ref(model)}}


def _events(*models: type[BaseModel]) -> dict[str, Any]:
    """Server-sent events whose `data` is JSON of one of `models`, or `[DONE]`."""
    one = ref(models[0]) if len(models) == 1 else {"anyOf": [ref(x) for x in models]}
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": one},
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


def route_table() -> list[Route]:
    error = m.ErrorResponse  # a stream that fails after its 200 ends with one
    chat = as_json(m.ChatCompletion) | _events(m.ChatCompletionChunk, m.ChatUsageChunk, error)
    text = as_json(m.TextCompletion) | _events(m.TextCompletionChunk, m.TextUsageChunk, error)
    answer = as_json(rb.ResponseObject) | _events(*rb.STREAM_EVENTS)
    reply = as_json(am.MessageReply) | _events(*am.STREAM_EVENTS)
    whole = {"application/json": {"schema": {"type": "object"}}}
    return [
        Route("post /v1/chat/completions", chat, ChatCompletionRequest, errors=COMPLETE),
        Route("post /v1/completions", text, CompletionRequest, errors=COMPLETE),
        Route("post /v1/responses", answer, r.ResponseCreateRequest, errors=COMPLETE),
        Route("get /v1/models", as_json(m.ModelList)),
        Route("post /tokenize", as_json(m.Tokens), TokenizeRequest, errors=TOKENS),
        Route("post /detokenize", as_json(m.Detokenized), DetokenizeRequest, errors=TOKENS),
        Route("post /v1/embeddings", as_json(e.EmbeddingList), e.EmbeddingRequest, errors=COMPLETE),
        Route("post /v1/messages", reply, MessagesRequest, errors=COMPLETE),
        Route(
            "post /v1/messages/count_tokens",
            as_json(am.MessageTokens),
            CountTokensRequest,
            errors=TOKENS,
        ),
        Route("post /v1/prefixes", as_json(a.PrefixCreated), PinCreate, 201, PIN),
        Route("get /v1/prefixes", as_json(a.PrefixList)),
        Route("delete /v1/prefixes/{name}", as_json(a.PrefixDeleted), errors=LOOKUP),
        Route("get /health", as_json(a.Health), errors=PUBLIC),
        Route("get /ready", as_json(a.Readiness), errors=PUBLIC),
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
    tenant = ("tenant_id", TEXT_PARAM, "Only this tenant's rows.")
    usage = (tenant, ("since", day, "First day (UTC), inclusive."), ("until", day, "Last day."))
    limit = {"type": "integer", "minimum": 1, "maximum": 1000, "default": 20}
    report = (tenant, ("limit", limit, "How many prefixes."))
    interval = {"type": "number", "default": 1}
    every = (("interval", interval, "Seconds between snapshots; less than 0.1 is 0.1."),)
    return [
        Route("post /admin/tenants", as_json(a.Tenant), TenantCreate, 201, CREATE),
        Route("get /admin/tenants", as_json(a.TenantList)),
        Route("get /admin/tenants/{tenant_id}", as_json(a.Tenant), errors=LOOKUP),
        Route("patch /admin/tenants/{tenant_id}", as_json(a.Tenant), TenantUpdate, errors=UPDATE),
        Route("delete /admin/tenants/{tenant_id}", as_json(a.TenantDeleted), errors=LOOKUP),
        Route(
            "post /admin/tenants/{tenant_id}/keys", as_json(a.ApiKeyCreated), KeyCreate, 201, KEY
        ),
        Route("get /admin/tenants/{tenant_id}/keys", as_json(a.ApiKeyList), errors=LOOKUP),
        Route("get /admin/keys/{key_id}", as_json(a.ApiKey), errors=LOOKUP),
        Route("patch /admin/keys/{key_id}", as_json(a.ApiKey), KeyUpdate, errors=KEY),
        Route("delete /admin/keys/{key_id}", as_json(a.ApiKey), errors=LOOKUP),
        Route("get /admin/usage", as_json(a.UsageReport), errors=LOOKUP, query=usage),
        Route("get /admin/backends", as_json(a.BackendList)),
        Route("get /admin/stats", as_json(a.StatsSnapshot)),
        Route("get /admin/stats/stream", _events(a.StatsSnapshot), query=every),
        Route("get /admin/prefixes", as_json(a.PrefixReport), errors=LOOKUP, query=report),
        Route("post /admin/prefixes/pins", as_json(a.PrefixCreated), AdminPinCreate, 201, PIN),
        Route("delete /admin/prefixes/pins/{pin_id}", as_json(a.PrefixDeleted), errors=LOOKUP),
        Route(
            "post /admin/adapters", as_json(a.Adapter), AdapterCreate, 201, (*LOOKUP, *BODY, 503)
        ),
        Route("get /admin/adapters", as_json(a.AdapterList)),
        Route("delete /admin/adapters/{name}", as_json(a.AdapterDeleted), errors=LOOKUP),
        Route("post /admin/reload", as_json(a.Reloaded)),
        Route("get /admin/audit", as_json(a.AuditList), query=_audit_query()),
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
        ("action", TEXT_PARAM, "One action (key.revoke), or a family with no dot (key)."),
        ("target", TEXT_PARAM, "Only changes to this id or name."),
        ("tenant_id", TEXT_PARAM, "Only changes that concern this tenant."),
        ("since", when, "UNIX seconds or ISO 8601 (UTC unless it says), inclusive."),
        ("until", when, "UNIX seconds or ISO 8601, exclusive."),
        ("limit", page, "How many rows."),
        ("cursor", cursor, "The next_cursor of the page before."),
    )
