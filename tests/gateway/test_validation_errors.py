"""Every validation error a client can get is in the API's own words (issue 45, item 8):
a live gateway's /openapi.json is walked, every field of every route's request body
(nested ones, each union member's, admin bodies included) is sent a value of a type or
range it does not take, and each answer must be a 400 in the route's error shape whose
message names the field by its path and shows nothing of the implementation (pydantic's
validator names, memory addresses, Python types)."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel

import gateway.app  # noqa: F401  (every model of the gateway's routes)
import gateway.worker.app  # noqa: F401  (and of a worker's)
from gateway.http.errors import is_anthropic, is_ollama
from gateway.schemas.base import StrictBody
from tests.conftest import ADMIN_KEY

# Ollama's routes that change the models directory: an admin key's (a tenant's is a 403)
OLLAMA_ADMIN = {"/api/copy", "/api/create", "/api/delete"}

INTERNALS = re.compile(
    r"0x[0-9a-f]{6,}|functools|function-after|function-before|<class|pydantic|Traceback",
    re.IGNORECASE,
)
# one value of each JSON type: sent where a field takes none of that type
WRONG = {"string": "x", "integer": 7, "number": 1.5, "boolean": True, "array": [1], "object": {}}
DEPTH = 8  # how deep into a body (its nested objects and arrays) fields are tried

Put = Callable[[Any], Any]  # the whole body, with this value at the field


def path_text(path: list[str | int]) -> str:
    """A field's path as the gateway names it: input[0][1], messages[0].content."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


class Walker:
    """The cases of one request body: (field path, the body with a wrong value there)."""

    def __init__(self, doc: dict[str, Any], body_schema: dict[str, Any]) -> None:
        self.defs = doc["components"]["schemas"]
        root = body_schema | {"components": doc["components"]}
        self.validator = Draft202012Validator(root)

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.defs[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def alternatives(self, schema: dict[str, Any]) -> list[dict[str, Any]]:
        schema = self.resolve(schema)
        alts = schema.get("anyOf") or schema.get("oneOf")
        if not alts:
            return [schema]
        return [a for alt in alts for a in self.alternatives(alt)]

    def synth(self, schema: dict[str, Any], depth: int = 0) -> Any:
        """A small value the schema takes (its required fields only)."""
        schema = self.alternatives(schema)[0]
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return schema["enum"][0]
        kind = schema.get("type")
        if kind == "object" and depth < DEPTH:
            props = schema.get("properties", {})
            return {p: self.synth(props[p], depth + 1) for p in schema.get("required", [])}
        if kind == "array" and depth < DEPTH:
            items = schema.get("items", {})
            return [self.synth(items, depth + 1)] * max(1, schema.get("minItems", 1))
        if kind == "string":
            return "x" * max(1, schema.get("minLength", 1))
        if kind in ("integer", "number"):
            low = schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1)
            return max(low, 1) if schema.get("maximum", 1) >= 1 else low
        return {} if kind == "object" else False

    def wrong_values(self, schema: dict[str, Any]) -> Iterator[Any]:
        """Values of a type the field takes in none of its forms, and numbers and
        strings just outside the bounds of its only form that has them."""
        alts = [a for a in self.alternatives(schema) if a.get("type") != "null"]
        kinds: set[str] = set()
        for alt in alts:
            if "const" in alt or "enum" in alt:
                kinds |= {_json_type(v) for v in alt.get("enum", [alt.get("const")])}
            elif "type" in alt:
                kinds |= set(alt["type"]) if isinstance(alt["type"], list) else {alt["type"]}
            else:
                return  # it takes anything
        if "number" in kinds:
            kinds.add("integer")
        yield from (value for kind, value in WRONG.items() if kind not in kinds)
        if len(alts) != 1:
            return
        alt = alts[0]
        if alt.get("type") in ("integer", "number"):
            step = 1 if alt["type"] == "integer" else 0.5
            if "minimum" in alt:
                yield alt["minimum"] - step
            if "exclusiveMinimum" in alt:
                yield alt["exclusiveMinimum"]
            if "maximum" in alt:
                yield alt["maximum"] + step
                yield alt["maximum"] * 2**20  # past what 64 bits hold, for the widest
        if alt.get("type") == "string" and alt.get("maxLength", 10**6) < 10**5:
            yield "x" * (alt["maxLength"] + 1)

    def cases(
        self, schema: dict[str, Any], value: Any, path: list[str | int], put: Put, depth: int = 0
    ) -> Iterator[tuple[list[str | int], Any]]:
        for wrong in self.wrong_values(schema):
            yield path, put(wrong)
        if depth >= DEPTH:
            return
        for alt in self.alternatives(schema):
            if alt.get("type") == "object":
                yield from self._fields(alt, value, path, put, depth)
            elif alt.get("type") == "array" and "items" in alt:
                base = value if isinstance(value, list) and value else [self.synth(alt["items"])]
                if self.takes(put(base)):

                    def at_first(v: Any, base: list = base, put: Put = put) -> Any:
                        return put([v, *base[1:]])

                    yield from self.cases(alt["items"], base[0], [*path, 0], at_first, depth + 1)

    def _fields(
        self, alt: dict[str, Any], value: Any, path: list[str | int], put: Put, depth: int
    ) -> Iterator[tuple[list[str | int], Any]]:
        base = value if isinstance(value, dict) and self._is_this(alt, value) else self.synth(alt)
        if not self.takes(put(base)):
            return  # a body this form cannot be part of: its fields are not reached
        fields = dict(alt.get("properties", {}))
        extra = alt.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            fields[next(iter(base), "k")] = extra
        for name, schema in fields.items():

            def at_field(v: Any, base: dict = base, name: str = name, put: Put = put) -> Any:
                return put(base | {name: v})

            child = base.get(name, self.synth(schema))
            yield from self.cases(schema, child, [*path, name], at_field, depth + 1)

    def _is_this(self, alt: dict[str, Any], value: dict[str, Any]) -> bool:
        """Whether `value` is of this form of a union (its constant fields agree)."""
        props = alt.get("properties", {})
        consts = {k: self.resolve(s)["const"] for k, s in props.items() if "const" in s}
        return all(value.get(k) == c for k, c in consts.items())

    def takes(self, body: Any) -> bool:
        return self.validator.is_valid(body)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {str: "string", float: "number", list: "array", dict: "object"}.get(type(value), "null")


def body_cases(doc: dict[str, Any]) -> Iterator[tuple[str, str, list[str | int], Any]]:
    """(method, path, field path, body) for every field of every route's body; only
    bodies the published schema refuses (a value another form of a union takes is no
    wrong value)."""
    for route, methods in doc["paths"].items():
        for method, op in methods.items():
            if "requestBody" not in op:
                continue
            content = op["requestBody"]["content"]["application/json"]
            example = next(iter(content["examples"].values()))["value"]
            walker = Walker(doc, content["schema"])
            assert walker.takes(example), (route, example)
            seen = set()
            for field, body in walker.cases(content["schema"], example, [], copy.deepcopy):
                key = (path_text(field), json.dumps(body, sort_keys=True))
                if key not in seen and not walker.takes(body):
                    seen.add(key)
                    yield method, route, field, body


async def test_every_field_of_every_body_is_refused_in_the_apis_words(gw):
    tenant, key = await gw.tenant()
    keys = (await gw.admin("GET", f"/admin/tenants/{tenant['id']}/keys"))[1]["data"]
    async with gw.http.get(gw.url + "/openapi.json") as r:
        doc = await r.json()
    ids = {"tenant_id": tenant["id"], "key_id": keys[0]["id"]}
    routes, tried, failures = set(), 0, []
    for method, route, field, body in body_cases(doc):
        routes.add(route)
        url = gw.url + re.sub(r"{(\w+)}", lambda m: ids[m.group(1)], route)
        secret = ADMIN_KEY if route.startswith("/admin/") or route in OLLAMA_ADMIN else key
        headers = {"Authorization": f"Bearer {secret}"}
        async with gw.http.request(method, url, json=body, headers=headers) as r:
            status, answer = r.status, await r.json()
        tried += 1
        problem = _problem(route, path_text(field), status, answer)
        if problem:
            failures.append(f"{method} {route} {path_text(field)}={_short(body)}: {problem}")
    assert not failures, f"{len(failures)} of {tried}:\n" + "\n".join(failures[:40])
    # every body the issue names was walked, deep into it
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"):
        assert route in routes
    for route in ("/v1/messages/count_tokens", "/v1/responses", "/tokenize", "/detokenize"):
        assert route in routes
    assert "/admin/tenants" in routes and "/admin/keys/{key_id}" in routes
    for route in ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"):
        assert route in routes
    assert tried > 500


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ([[1, "a"]], "input[0][1]: must be an integer"),
        ([[-1]], "input[0][0]: must be at least 0"),
        ([1.5], "input[0]: must be a string, an integer or an array"),
        ([[2**40]], "input[0][0]: must be at most 2147483647"),
        ([[1], [2, None]], "input[1][1]: must be an integer"),
        (5, "input: must be a string or an array"),
    ],
)
async def test_token_arrays_of_the_wrong_type_or_range_say_which_item(gw, given, said):
    _, key = await gw.tenant()
    async with await gw.post("/v1/embeddings", key, {"model": "fake-model", "input": given}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert (error["message"], error["param"]) == (said, said.split(":")[0])


def test_no_request_model_wraps_a_bound_in_a_function_of_its_own():
    """A bound pydantic cannot put on the type it bounds becomes a functools.partial
    validator, whose repr lands in errors: every bound must be the type's own
    (gateway.schemas.fields.IntIn for integers)."""

    def partials(node: Any) -> Iterator[Any]:
        if isinstance(node, functools.partial):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from partials(value)
        elif isinstance(node, list | tuple):
            for value in node:
                yield from partials(value)

    def models(cls: type[BaseModel]) -> Iterator[type[BaseModel]]:
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("gateway."):
                yield sub
            yield from models(sub)

    checked = set(models(BaseModel))  # the gateway's and the worker's apps import them all
    assert StrictBody in checked and len(checked) > 50
    for model in checked:
        found = list(partials(model.__pydantic_core_schema__))
        assert not found, (model.__name__, found[:1])


def _problem(route: str, field: str, status: int, answer: dict) -> str | None:
    """What is wrong with the answer to a body whose `field` is wrong; None if nothing."""
    if status != 400:
        return f"status {status}: {answer}"
    if is_anthropic(route):
        if set(answer) != {"type", "error"} or answer["type"] != "error":
            return f"not Anthropic's error shape: {answer}"
        if answer["error"]["type"] != "invalid_request_error":
            return f"error type {answer['error']['type']}"
    elif is_ollama(route):
        if set(answer) != {"error"} or not isinstance(answer["error"], str):
            return f"not Ollama's error shape: {answer}"
    elif set(answer.get("error", {})) != {"message", "type", "param", "code"}:
        return f"not OpenAI's error shape: {answer}"
    error = answer["error"]
    message = error if isinstance(error, str) else error["message"]
    if INTERNALS.search(message):
        return f"internals in {message!r}"
    if field and field not in message:
        return f"the field is not named in {message!r}"
    return None


def _short(body: Any) -> str:
    text = json.dumps(body)
    return text if len(text) < 200 else text[:200] + "..."
