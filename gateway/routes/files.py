"""OpenAI's Files API, tenant-scoped: POST /v1/files (multipart; purpose `batch`, a JSONL
input checked line by line), GET /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content
and DELETE /v1/files/{id}. Another tenant's file is a 404, as one that does not exist."""

from __future__ import annotations

import asyncio

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import ValidationError

from gateway.batches.jsonl import check_lines
from gateway.batches.start import BATCHES
from gateway.http.errors import ApiError
from gateway.http.util import invalid, json_response
from gateway.schemas.files import PURPOSES, FileListQuery, file_object
from gateway.serving.model_access import tenant_of
from gateway.state import GW

MAX_FILENAME = 255
MAX_PURPOSE = 64  # bytes of the form's purpose field read at most
LARGE_FILE_BYTES = 256 * 1024  # checked in a worker thread past this


async def create_file(request: web.Request) -> web.Response:
    gw = request.app[GW]
    tenant_id = tenant_of(await gw.authenticate(request))
    try:
        purpose, filename, data = await _read_form(request, gw.settings.max_file_bytes)
    except (ValueError, HttpProcessingError, web.RequestPayloadError):
        raise ApiError(400, "The multipart body is malformed.") from None
    if purpose not in PURPOSES:
        raise ApiError(400, f"purpose must be one of {list(PURPOSES)}.", param="purpose")
    max_lines = gw.settings.max_file_lines
    if len(data) > LARGE_FILE_BYTES:
        await asyncio.to_thread(check_lines, data, max_lines)
    else:
        check_lines(data, max_lines)
    row = await request.app[BATCHES].files.create(tenant_id, purpose, filename, data)
    return json_response(file_object(row))


async def _read_form(request: web.Request, limit: int) -> tuple[str | None, str, bytes]:
    """The form's `purpose` and `file` (its name and bytes, at most `limit` of them)."""
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "Send the file as multipart/form-data with `file` and `purpose`.")
    purpose, filename, data = None, None, None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise ApiError(400, "Nested multipart bodies are not taken.")
        if part.name == "purpose":
            purpose = (await _read_bounded(part, MAX_PURPOSE)).decode("utf-8", "replace")
        elif part.name == "file":
            # kept as metadata only (never a path); printable, as PostgreSQL stores it
            filename = "".join(c for c in part.filename or "" if c.isprintable())[:MAX_FILENAME]
            data = await _read_bounded(part, limit)
        else:
            await part.release()
    if data is None:
        raise ApiError(400, "The form has no `file`.", param="file")
    return purpose, filename or "file.jsonl", data


async def _read_bounded(part: BodyPartReader, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 16):
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"The {part.name} field is larger than {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def list_files(request: web.Request) -> web.Response:
    gw = request.app[GW]
    tenant_id = tenant_of(await gw.authenticate(request))
    given = dict(request.query)
    try:
        q = FileListQuery.model_validate(given)
    except ValidationError as e:
        raise invalid(e, given) from None
    files = request.app[BATCHES].files
    rows, more = await files.page(tenant_id, q.purpose, q.after, q.limit, q.order == "desc")
    data = [file_object(r) for r in rows]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    page = {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
    return json_response(page)


async def retrieve_file(request: web.Request) -> web.Response:
    _, row = await _own_file(request)
    return json_response(file_object(row))


async def file_content(request: web.Request) -> web.Response:
    files, row = await _own_file(request)
    data = await files.read(row.id)
    return web.Response(body=data, content_type="application/octet-stream")


async def delete_file(request: web.Request) -> web.Response:
    gw = request.app[GW]
    tenant_id = tenant_of(await gw.authenticate(request))
    file_id = request.match_info["file_id"]
    if not await request.app[BATCHES].files.delete(tenant_id, file_id):
        raise _not_found(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


async def _own_file(request: web.Request):
    gw = request.app[GW]
    tenant_id = tenant_of(await gw.authenticate(request))
    files, file_id = request.app[BATCHES].files, request.match_info["file_id"]
    row = await files.get(tenant_id, file_id)
    if row is None:
        raise _not_found(file_id)
    return files, row


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", code="file_not_found", param="id")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
