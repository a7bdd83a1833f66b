"""OpenAI's Batch API, tenant-scoped: POST /v1/batches, GET /v1/batches (newest first,
`after` and `limit` as OpenAI pages them), GET /v1/batches/{id} and POST
/v1/batches/{id}/cancel. The lines run in the gateway's batch runner (gateway.batches)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from pydantic import ValidationError

from gateway.batches import store
from gateway.batches.jsonl import check_lines
from gateway.batches.start import BATCHES
from gateway.http.errors import ApiError
from gateway.http.util import invalid, json_response, parse_body
from gateway.schemas.batches import BatchCreate, BatchListQuery, batch_object
from gateway.serving.model_access import tenant_of
from gateway.state import GW

MAX_NAMED = 5  # lines of another endpoint a refusal names


async def create_batch(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    tenant_id = tenant_of(principal)
    body = await parse_body(request, BatchCreate)
    room = request.app[BATCHES]
    f = await room.files.get(tenant_id, body.input_file_id)
    if f is None:
        raise ApiError(404, f"No such File object: {body.input_file_id}", param="input_file_id")
    if f.purpose != "batch":
        raise ApiError(400, "The input file's purpose must be `batch`.", param="input_file_id")
    data = await room.files.read(f.id)
    lines = await asyncio.to_thread(check_lines, data, gw.settings.max_file_lines)
    other = [str(i + 1) for i, ln in enumerate(lines) if ln.url != body.endpoint]
    if other:
        raise ApiError(
            400,
            f"Every line's url must be the batch's endpoint {body.endpoint}; lines "
            f"{', '.join(other[:MAX_NAMED])} are not.",
            param="endpoint",
        )
    batch = await store.create(
        gw.db,
        tenant_id,
        principal.key_id,
        body.endpoint,
        f.id,
        body.completion_window,
        body.metadata,
        lines,
    )
    room.runner.wake()
    return json_response(batch_object(batch))


async def list_batches(request: web.Request) -> web.Response:
    gw = request.app[GW]
    tenant_id = tenant_of(await gw.authenticate(request))
    given = dict(request.query)
    try:
        q = BatchListQuery.model_validate(given)
    except ValidationError as e:
        raise invalid(e, given) from None
    rows, more = await store.page(gw.db, tenant_id, q.after, q.limit)
    data = [batch_object(r) for r in rows]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    page = {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
    return json_response(page)


async def retrieve_batch(request: web.Request) -> web.Response:
    gw = request.app[GW]
    tenant_id = tenant_of(await gw.authenticate(request))
    return json_response(batch_object(await _own_batch(request, tenant_id)))


async def cancel_batch(request: web.Request) -> web.Response:
    gw = request.app[GW]
    tenant_id = tenant_of(await gw.authenticate(request))
    batch = await _own_batch(request, tenant_id)
    if not await store.cancel(gw.db, batch.id):
        raise ApiError(409, f"A batch that is {batch.status} cannot be cancelled.")
    request.app[BATCHES].runner.wake()
    return json_response(batch_object(await _own_batch(request, tenant_id)))


async def _own_batch(request: web.Request, tenant_id: str):
    batch_id = request.match_info["batch_id"]
    batch = await store.get(request.app[GW].db, batch_id, tenant_id)
    if batch is None:
        raise ApiError(404, f"No such Batch object: {batch_id}", code="batch_not_found")
    return batch


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
