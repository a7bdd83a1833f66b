"""/openapi.json: valid OpenAPI 3.1, served without a key, naming every route the app
registers, its request schemas the very ones pydantic validates with, and its response
schemas true to what the server sends (checked here on real responses of every kind;
tests/gateway/test_fuzz.py checks thousands more)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import pytest
import schemathesis

from gateway.routes.openapi import build_document
from gateway.routes.openapi_requests import EXAMPLES, REQUEST_MODELS
from gateway.routes.openapi_routes import REF
from tests.conftest import ADMIN_KEY


@pytest.fixture
async def doc(gw) -> dict[str, Any]:
    async with gw.http.get(gw.url + "/openapi.json") as r:  # no Authorization header
        assert r.status == 200, await r.text()
        assert r.content_type == "application/json"
        return await r.json()


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


async def test_document_is_valid_openapi(doc):
    assert doc["openapi"].startswith("3.1.")
    schemathesis.openapi.from_dict(doc).validate()  # the OpenAPI 3.1 meta-schema
    for name, schema in doc["components"]["schemas"].items():
        assert jsonschema_rs.meta.is_valid(schema | {"$schema": DRAFT}), name
    for ref in _refs(doc):  # every $ref points at something
        section, kind, name = ref.removeprefix("#/").split("/")
        assert name in doc[section][kind], ref
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A kvg- key.",
    }
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []


DRAFT = "https://json-schema.org/draft/2020-12/schema"


async def test_every_route_is_documented(gw, doc):
    registered = {
        (r.method.lower(), r.resource.canonical)
        for r in gw.server.app.router.routes()
        if r.method != "HEAD"  # aiohttp's automatic twin of each GET
    }
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == registered
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            params = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert params == {s.strip("{}") for s in path.split("/") if s.startswith("{")}
            errors = [code for code in op["responses"] if code >= "400"]
            assert "400" in errors, (method, path)  # a control character in the URL


@pytest.mark.parametrize("model", REQUEST_MODELS, ids=lambda m: m.__name__)
def test_request_schemas_are_the_models_own(model):
    doc = build_document()
    own = model.model_json_schema(ref_template=REF)
    nested = own.pop("$defs", {})
    schemas = doc["components"]["schemas"]
    assert schemas[model.__name__] == own
    for name, schema in nested.items():
        assert schemas[name] == schema
    bodies = [
        op["requestBody"]["content"]["application/json"]
        for ops in doc["paths"].values()
        for op in ops.values()
        if "requestBody" in op
    ]
    uses = [b for b in bodies if b["schema"] == {"$ref": REF.format(model=model.__name__)}]
    assert len(uses) == 1
    for example in uses[0]["examples"].values():  # each example is a valid request
        model.model_validate_json(json.dumps(example["value"]))
    assert len(uses[0]["examples"]) == len(EXAMPLES[model])


def _validator(doc: dict, schema: dict) -> jsonschema_rs.Validator:
    return jsonschema_rs.Draft202012Validator(schema | {"components": doc["components"]})


def _schema(doc: dict, method: str, path: str, status: int, media: str) -> dict:
    response = doc["paths"][path][method]["responses"][str(status)]
    if "$ref" in response:
        response = doc["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    return response["content"][media]["schema"]


async def _call(gw, doc, method, path, key=ADMIN_KEY, status=200, body=None, route=None):
    """A real request whose status, content type and body must be as documented."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with gw.http.request(method, gw.url + path, json=body, headers=headers) as r:
        raw = await r.read()
        assert r.status == status, raw
        media = r.content_type
    schema = _schema(doc, method.lower(), route or path.split("?")[0], status, media)
    if media != "text/event-stream":
        data = json.loads(raw) if media == "application/json" else raw.decode()
        _validator(doc, schema).validate(data)
        return data
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    each = _validator(doc, schema["properties"]["data"]["else"]["contentSchema"])
    for event in events[:-1]:
        each.validate(json.loads(event))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_responses_are_as_documented(gw, doc):
    assert (await _call(gw, doc, "GET", "/health", key=None)) == {"status": "ok", "down": {}}
    await _call(gw, doc, "GET", "/ready", key=None)
    tenant = await _call(gw, doc, "POST", "/admin/tenants", status=201, body={"name": "acme"})
    t = f"/admin/tenants/{tenant['id']}"
    key = (await _call(gw, doc, "POST", t + "/keys", status=201, body={}, route=KEYS))["key"]
    await _call(gw, doc, "PATCH", t, body={"rpm": 100}, route=TENANT)
    await _call(gw, doc, "GET", "/v1/models", key)
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    chat |= {"max_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 2}
    await _call(gw, doc, "POST", "/v1/chat/completions", key, body=chat)
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = await _call(gw, doc, "POST", "/v1/chat/completions", key, body=chat | stream)
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    text = {"model": "fake-model", "prompt": ["a b", "c d"], "max_tokens": 2, "logprobs": 1}
    await _call(gw, doc, "POST", "/v1/completions", key, body=text)
    await _call(gw, doc, "POST", "/v1/completions", key, body=text | stream)
    pin = {"name": "bot", "text": "You are a bot."}
    await _call(gw, doc, "POST", "/v1/prefixes", key, status=201, body=pin)
    shared = pin | {"tenant": None, "name": "house", "shared": True}
    published = await _call(gw, doc, "POST", "/admin/prefixes/pins", status=201, body=shared)
    await _call(gw, doc, "GET", "/v1/prefixes", key)
    await _call(gw, doc, "GET", "/admin/prefixes?limit=5")
    await _call(gw, doc, "DELETE", "/v1/prefixes/bot", key, route="/v1/prefixes/{name}")
    await _call(gw, doc, "DELETE", f"/admin/prefixes/pins/{published['id']}", route=PIN)
    for path in ("/admin/tenants", "/admin/usage", "/admin/backends", "/admin/stats"):
        await _call(gw, doc, "GET", path)
    await _call(gw, doc, "GET", t, key, route=TENANT)
    keys = await _call(gw, doc, "GET", t + "/keys", route=KEYS)
    await _call(gw, doc, "DELETE", f"/admin/keys/{keys['data'][0]['id']}", route=KEY)
    await _call(gw, doc, "DELETE", t, route=TENANT)


TENANT = "/admin/tenants/{tenant_id}"
KEYS = TENANT + "/keys"
KEY = "/admin/keys/{key_id}"
PIN = "/admin/prefixes/pins/{pin_id}"


async def test_errors_are_as_documented(gw, doc):
    _, key = await gw.tenant()
    await _call(gw, doc, "GET", "/v1/models", None, status=401)
    await _call(gw, doc, "GET", "/admin/stats", key, status=403)
    await _call(gw, doc, "GET", "/admin/tenants/t_none", status=404, route=TENANT)
    bad = {"model": "fake-model", "messages": []}
    await _call(gw, doc, "POST", "/v1/chat/completions", key, status=400, body=bad)
    await _call(gw, doc, "POST", "/admin/tenants", status=409, body={"name": "acme"})
    async with gw.http.get(
        gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ) as r:
        assert r.status == 200 and r.content_type == "text/plain"
        assert "kvgate:requests" in await r.text()
    async with gw.http.get(
        gw.url + "/admin/stats/stream?interval=0.1",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ) as r:
        assert r.content_type == "text/event-stream"
        first = (await r.content.readuntil(b"\n\n")).decode()
    schema = _schema(doc, "get", "/admin/stats/stream", 200, "text/event-stream")
    each = _validator(doc, schema["properties"]["data"]["else"]["contentSchema"])
    each.validate(json.loads(first.removeprefix("data: ")))
