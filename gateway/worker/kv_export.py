"""POST /kvgate/v1/kv/export: a prefill worker's side of prefill and decode on different
workers (the decode worker's side is kv_pull.py).

The body is the GenRequest the gateway prefilled here; the reply is the records of that
prompt's blocks the engine holds, framed (gateway.backends.kv_transfer). A backend that
does not move blocks (llama.cpp, the fake one) answers 400 saying so, as does a gpu
engine started with role both.
"""

from __future__ import annotations

from aiohttp import web

from engine_api.errors import BackendError, BadRequestError
from gateway.backends.kv_transfer import FRAMED, KVTransferBackend, pack_records
from gateway.http.errors import ApiError
from gateway.worker.errors import api_error
from gateway.worker.generate import read_request
from gateway.worker.state import WORKER


async def export_kv(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    req = await read_request(request)
    if not isinstance(state.backend, KVTransferBackend):
        raise ApiError(
            400,
            f"this worker's {state.kind} backend does not move KV blocks between workers "
            "(a gpu worker started with --role prefill or decode does)",
        )
    try:
        records = await state.backend.export_kv(req)
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    return web.Response(body=pack_records(records), content_type=FRAMED)
