"""Small helpers shared by the HTTP handlers."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from gateway.errors import ApiError

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: web.Request, model: type[M]) -> M:
    raw = await request.read()  # aiohttp raises 413 past client_max_size
    if not raw:
        raise ApiError(400, "The request body is empty; expected a JSON object.")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        if first["type"] == "json_invalid":
            raise ApiError(400, f"The body is not valid JSON: {first['msg']}") from None
        msg = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()
        )
        raise ApiError(400, msg, param=param) from None


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None):
    return web.Response(
        body=json.dumps(data, separators=(",", ":")),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
