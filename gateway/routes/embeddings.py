"""POST /v1/embeddings (OpenAI's): parse the body, embed (gateway.serving.embedding), and
answer the vectors as floats or base64."""

from __future__ import annotations

from aiohttp import web

from gateway.http.util import parse_body
from gateway.schemas.embeddings import EmbeddingRequest
from gateway.serving.embedding import embed
from gateway.serving.embedding_answer import answer_bytes
from gateway.state import GW


async def embeddings(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, EmbeddingRequest)
    done = await embed(gw, principal, body)
    raw = await answer_bytes(done.model, done.vectors, done.prompt_tokens, body.encoding_format)
    return web.Response(body=raw, content_type="application/json", headers=done.headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
