"""A batch line served as the request of its endpoint (the runner's `execute`,
gateway.batches.runner): the body validated as the route validates it, admitted by the
same `prepare` (quotas, fair share, tracing) and answered by the same code that builds
the route's whole answer, in process; no HTTP loopback. Its Job carries the batch and
custom_id into its usage row, and the batch price."""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError

from gateway.batches.prices import batch_price
from gateway.batches.runner import LineAnswer
from gateway.http.errors import ApiError
from gateway.http.util import invalid
from gateway.routes import messages, openai
from gateway.schemas.embeddings import EmbeddingRequest
from gateway.schemas.inference import ChatCompletionRequest, CompletionRequest
from gateway.schemas.messages import MessagesRequest
from gateway.serving.admission import prepare
from gateway.serving.embedding import embed
from gateway.serving.embedding_answer import answer_bytes
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal


async def execute(
    gw: GatewayState, principal: Principal, endpoint: str, body: dict, tag: tuple[str, str]
) -> LineAnswer:
    """The line's answer: its status, request id and body, as the route would send them."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    try:
        if endpoint == "/v1/embeddings":
            req = _validated(EmbeddingRequest, body)
            price = batch_price(gw, req.model)
            done = await embed(gw, principal, req, tag, price)
            raw = await answer_bytes(
                done.model, done.vectors, done.prompt_tokens, req.encoding_format
            )
            return LineAnswer(200, done.request_id, json.loads(raw))
        if endpoint == "/v1/messages":
            msg = _validated(MessagesRequest, body)
            job = await prepare(gw, principal, msg.chat, chat=True, id_prefix="msg_")
            _tag(gw, job, tag)
            resp = await messages._whole(job)
        else:
            chat = endpoint == "/v1/chat/completions"
            req = _validated(ChatCompletionRequest if chat else CompletionRequest, body)
            job = await prepare(gw, principal, req, chat)
            _tag(gw, job, tag)
            resp = await openai._whole(job)
        return LineAnswer(resp.status, job.request_id, json.loads(resp.body))  # type: ignore[arg-type]
    except ApiError as e:
        return LineAnswer(e.status, None, e.body())


def _validated(model: type[BaseModel], body: dict):
    try:
        return model.model_validate_json(json.dumps(body))  # as the route: from JSON
    except ValidationError as e:
        raise invalid(e, body) from None


def _tag(gw: GatewayState, job, tag: tuple[str, str]) -> None:
    """The Job bills as a batch line: named by batch and custom_id, at the batch price."""
    job.batch = tag
    job.price = batch_price(gw, job.model)
