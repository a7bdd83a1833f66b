"""The HTTP reference of the docs (docs/reference/http.md), generated at every `make
docs` from the document the gateway serves at GET /openapi.json (gateway.routes.openapi,
itself built from the pydantic models that validate the bodies): every route, its
parameters, body, examples and answers, then every schema's fields.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.routes.openapi import build_document

METHODS = ("get", "post", "patch", "delete")
CONSTRAINTS = {
    "minimum": ">= {}",
    "exclusiveMinimum": "> {}",
    "maximum": "<= {}",
    "exclusiveMaximum": "< {}",
    "minLength": "at least {} characters",
    "maxLength": "at most {} characters",
    "minItems": "at least {} items",
    "maxItems": "at most {} items",
    "maxProperties": "at most {} entries",
}


def _name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _link(ref: str) -> str:
    name = _name(ref)
    return f"[{name}](#{name.lower()})"


def type_of(schema: dict[str, Any]) -> str:
    """A JSON schema in a few words, schemas named by a link to their section."""
    if "$ref" in schema:
        return _link(schema["$ref"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(type_of(s) for s in schema[key]))
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"object of {type_of(schema['additionalProperties'])}"
    if isinstance(kind, list):
        return " or ".join(kind)
    return kind or "any"


def _constraints(schema: dict[str, Any]) -> list[str]:
    found = [text.format(schema[k]) for k, text in CONSTRAINTS.items() if k in schema]
    for option in schema.get("anyOf", []):
        found += _constraints(option)
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", "", op.get("summary", "")]
    if op.get("description"):
        lines += ["", op["description"]]
    if op.get("security") == []:
        lines += ["", "No key needed."]
    params = op.get("parameters", [])
    if params:
        lines += ["", "| Parameter | In | Type | What it is |", "|---|---|---|---|"]
        for p in params:
            required = " (required)" if p.get("required") else ""
            cells = (f"`{p['name']}`{required}", p["in"], type_of(p.get("schema", {})))
            lines.append("| " + " | ".join((*cells, _cell(p.get("description", "")))) + " |")
    body = op.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        lines += ["", f"Body ({media}): {type_of(content['schema'])}"]
        for example in content.get("examples", {}).values():
            lines += ["", "```json", json.dumps(example["value"], indent=2), "```"]
    lines += ["", "| Status | Answer |", "|---|---|"]
    errors = []
    for status, answer in op.get("responses", {}).items():
        if "$ref" in answer:  # one of the shared errors: listed once, under Errors
            errors.append(status)
            continue
        kinds = [
            f"{type_of(c['schema'])} ({media})" if "$ref" in c.get("schema", {}) else media
            for media, c in answer.get("content", {}).items()
        ]
        what = answer.get("description", "") + (" " + ", ".join(kinds) if kinds else "")
        lines.append(f"| {status} | {_cell(what)} |")
    if errors:
        lines += ["", "[Errors](#errors): " + ", ".join(errors)]
    return [*lines, ""]


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [schema["description"], ""]
    props = schema.get("properties")
    if not props:
        return [*lines, f"Type: {type_of(schema)}", ""]
    required = set(schema.get("required", []))
    lines += ["| Field | Type | Default | What it is |", "|---|---|---|---|"]
    for field, sub in props.items():
        default = f"`{json.dumps(sub['default'])}`" if "default" in sub else ""
        what = "; ".join(filter(None, [sub.get("description", ""), *_constraints(sub)]))
        mark = " (required)" if field in required else ""
        lines.append(f"| `{field}`{mark} | {type_of(sub)} | {default} | {_cell(what)} |")
    return [*lines, ""]


def http_reference() -> str:
    """Markdown: the routes by tag, then the schemas."""
    doc = build_document()
    by_tag: dict[str, list[str]] = {}
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                tag = (item[method].get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).extend(_operation(path, method, item[method]))
    lines = [doc["info"].get("description", ""), "", "## Errors", ""]
    lines += ["| Status | Body | When |", "|---|---|---|"]
    for name, answer in doc["components"]["responses"].items():
        bodies = ", ".join(type_of(c["schema"]) for c in answer.get("content", {}).values())
        lines.append(f"| {name[1:]} | {bodies} | {_cell(answer.get('description', ''))} |")
    lines.append("")
    for tag, ops in by_tag.items():
        lines += [f"## Routes: {tag}", "", *ops]
    lines += ["## Schemas", ""]
    for name, schema in doc["components"]["schemas"].items():
        lines += _schema(name, schema)
    return "\n".join(lines)


def openapi_json() -> str:
    """The document itself, as GET /openapi.json serves it."""
    return json.dumps(build_document(), indent=2) + "\n"
