"""POST /v1/embeddings on a worker: OpenAI's embeddings from the worker's embedding
model, for a gateway's `remote` entry with `task = "embed"` and for direct callers.

The body and the answer are the gateway's own (gateway/schemas/embeddings.py); inputs
are rendered with the worker's tokenizer (token ids pass as they are: a gateway sends
the ids the worker's /tokenize gave it) and held to the model's context, as the gateway
holds them. No tenant and no quota here: the gateway in front keeps those. A gateway
names its request (gateway.backends.remote_abort.REQUEST_ID_HEADER), so that, its client gone, it can stop the
request and hear the tokens of the inputs pooled by then (POST /kvgate/v1/abort).
"""

from __future__ import annotations

import os

from aiohttp import web

from engine_api.errors import BackendError, BadRequestError
from engine_api.records import EMBED, EmbedRequest
from gateway.backends import EmbeddingBackend
from gateway.http.errors import ApiError
from gateway.http.util import parse_body
from gateway.schemas.embeddings import EmbeddingRequest
from gateway.serving.embedding_answer import answer_bytes, check_dimensions
from gateway.serving.token_plan import check_input_tokens
from gateway.tenancy.quota import QuotaLimits
from gateway.worker.errors import api_error
from gateway.worker.running import request_id_of
from gateway.worker.state import WORKER


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    body = await parse_body(request, EmbeddingRequest)
    card = state.card(body.model)
    backend = state.backend
    if card.task != EMBED or not isinstance(backend, EmbeddingBackend):
        raise ApiError(400, f"The model `{card.id}` is not an embedding model.", param="model")
    check_dimensions(card, body.dimensions)
    request_id = request_id_of(request, "embd-" + os.urandom(12).hex())
    try:
        rendered = [await backend.render(body.model, x) for x in body.inputs()]
        tokens = check_input_tokens([len(r) for r in rendered], card.context_length, QuotaLimits())
        req = EmbedRequest(request_id, body.model, rendered, dimensions=body.dimensions)
        with state.running.track(request_id) as progress:
            result = await backend.embed(req, progress)
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    # the engine's own count: the gateway in front takes it only where it agrees
    count = result.prompt_tokens if result.prompt_tokens else tokens
    raw = await answer_bytes(body.model, result.embeddings, count, body.encoding_format)
    return web.Response(body=raw, content_type="application/json")
