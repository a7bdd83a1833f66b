"""Ollama's native API beside the OpenAI one, for the local tools that speak only it
(Open WebUI, Copilot's Ollama provider, langchain-ollama): /api/chat, /api/generate,
/api/embed, /api/embeddings, /api/tags, /api/ps, /api/show and /api/version.

A body is translated into the chat completion, completion or embedding request it
means (gateway.schemas.ollama) and served as one: admitted, metered, limited and billed
by the same Job (gateway.serving.admission) as /v1, so tenants, keys, quotas, fair share
and usage rows apply unchanged, and ended by the same rules (gateway.serving.outcome).
Replies stream as NDJSON unless `stream` is false; reasoning goes in `thinking`, tool
calls whole with their arguments as an object. Errors are Ollama's `{"error": ...}`
(gateway.http.errors). A models directory's model (gateway.ondemand) is held from the
request's start to its end: loaded first if it is not (its `load_duration`), kept after
it as the request's `keep_alive` says; /api/ps shows those loaded and when each expires.
The routes that manage models (pull, push, create, copy, delete) are
gateway.routes.ollama_manage's.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from gateway.backends import ModelCard
from gateway.http.errors import ApiError
from gateway.http.util import json_bytes, json_response, off_loop_if, parse_body
from gateway.ondemand import held, of
from gateway.routes import ollama_manage
from gateway.schemas.ollama import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    held_for,
    served_name,
)
from gateway.serving.admission import prepare
from gateway.serving.embedding import embed
from gateway.serving.job import Job
from gateway.serving.model_access import model_card, tenant_of
from gateway.serving.ollama_models import describe
from gateway.serving.outcome import (
    LARGE_CALL_CHARS,
    finish_or_503,
    streamed,
    whole_answer,
)
from gateway.serving.parsed_output import Piece, Whole, choice_outputs
from gateway.state import GW, GatewayState
from gateway.tenancy.auth import Principal

VERSION = "0.12.0"  # the Ollama API this one follows, as clients that check it read it
NDJSON = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"}


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


async def tags(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    return json_response({"models": [d.tag() for d in await _described(gw, principal)]})


async def ps(request: web.Request) -> web.Response:
    """The models loaded: a configured one always (loaded at start, it never expires), a
    models directory's while it is, with its expiry."""
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    models, running = of(gw), []
    for d in await _described(gw, principal):
        if models is None or not models.has(d.card.id):
            running.append(d.running())
        elif models.is_loaded(d.card.id):
            running.append(d.running(models.expires_at(d.card.id)))
    return json_response({"models": running})


async def show(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, OllamaShowRequest)
    card = _card(gw, principal, body.model or body.name or "")
    async with held(gw, card.id):  # a directory's model: its template is read once loaded
        card = _card(gw, principal, body.model or body.name or "")
        return json_response((await describe(gw, card)).show(gw))


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, OllamaChatRequest, "message")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generation(request, OllamaGenerateRequest, "response")


async def _generation(
    request: web.Request,
    model: type[OllamaChatRequest] | type[OllamaGenerateRequest],
    field: str,  # where the text goes: chat's "message", generate's "response"
) -> web.StreamResponse:
    """/api/chat and /api/generate: a load-only body answers at once; the rest is a
    chat (or, for raw generate, a completion) through admission, streamed or whole."""
    started = time.monotonic_ns()
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, model)
    card = _card(gw, principal, body.model)
    if not body.load_only:
        tenant_of(principal)  # an admin key's 403 before its model loads
    keep_alive, models = held_for(body.keep_alive), of(gw)
    if body.load_only and keep_alive == 0:  # Ollama's way to unload a model
        if models is not None and models.has(card.id):
            models.unload(card.id)
        return _loaded(body.model, {field: _empty(field)}, unload=True)
    async with held(gw, card.id, keep_alive) as loaded:
        if body.load_only:
            return _loaded(body.model, {field: _empty(field)}, unload=False)
        card = _card(gw, principal, body.model)  # once loaded, its context is known
        _check_context(card, body.num_ctx)
        chat = not getattr(body, "raw", False)
        job = await prepare(gw, principal, body.request, chat=chat)
        reply = _Reply(job, body.model, started, field, whole=not body.stream)
        reply.load_ns = loaded.waited_ns
        return await (_stream(request, reply) if body.stream else _whole(reply))


async def embed_many(request: web.Request) -> web.Response:
    started = time.monotonic_ns()
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, OllamaEmbedRequest)
    card = _card(gw, principal, body.model)
    tenant_of(principal)
    async with held(gw, card.id, held_for(body.keep_alive)) as loaded:
        done = await embed(gw, principal, body.request)
    answer = {
        "model": body.model,
        "embeddings": done.vectors,
        "total_duration": time.monotonic_ns() - started,
        "load_duration": loaded.waited_ns,
        "prompt_eval_count": done.prompt_tokens,
    }
    return json_response(answer, headers=done.headers)


async def embed_one(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, OllamaEmbeddingsRequest)
    card = _card(gw, principal, body.model)
    tenant_of(principal)
    async with held(gw, card.id, held_for(body.keep_alive)):
        done = await embed(gw, principal, body.request)
    return json_response({"embedding": done.vectors[0]}, headers=done.headers)


class _Reply:
    """One reply's NDJSON objects: what it says, and the closing one's counts and times."""

    def __init__(self, job: Job, model: str, started: int, field: str, whole: bool) -> None:
        self.job, self.model, self.started, self.field = job, model, started, field
        self.outputs = choice_outputs(job, whole) if job.chat else []
        self.first: int | None = None  # when the first output came: the prompt's end
        self.calls = Whole()
        self.load_ns = 0  # how long the request waited for its model's load

    def feed(self, chunk: Any) -> Piece:
        if self.first is None:
            self.first = time.monotonic_ns()
        if not self.outputs:
            return Piece(content=chunk.text)
        piece = self.outputs[0].feed(chunk)
        return self._held(piece)

    def take(self, chunk: Any) -> Piece | None:
        """A chunk of a whole reply: kept by its ChoiceOutput until `finish` (a raw
        prompt's text, which has none, comes back as content)."""
        if self.first is None:
            self.first = time.monotonic_ns()
        if not self.outputs:
            return Piece(content=chunk.text)
        self.outputs[0].take(chunk)
        return None

    def _held(self, piece: Piece) -> Piece:
        """Calls are sent whole, at the end, as Ollama sends them."""
        if not piece.calls:  # most chunks: nothing to hold
            return piece
        self.calls.add(Piece(calls=piece.calls))
        return Piece(piece.reasoning, piece.content)

    def finish(self, reason: str | None) -> tuple[Piece, str | None]:
        if not self.outputs:
            return Piece(), reason
        rest, reason = self.outputs[0].finish(reason)
        return self._held(rest), reason

    def said(self, piece: Piece, calls: bool = False) -> dict[str, Any]:
        """An object of the reply (done false) saying `piece`, with the calls if asked."""
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        tool_calls, content = _ollama_calls(self.calls.tool_calls()) if calls else ([], "")
        text = piece.content + content
        if self.field == "message":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if piece.reasoning:
                message["thinking"] = piece.reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = text
            if piece.reasoning:
                out["thinking"] = piece.reasoning
        return out | {"done": False}

    def done(self, reason: str | None, piece: Piece | None = None) -> dict[str, Any]:
        """The closing object: its piece (a whole reply's) or nothing, and the counts."""
        now = time.monotonic_ns()
        first = self.first or now
        out = self.said(piece or Piece(), calls=piece is not None)
        return out | {
            "done": True,
            "done_reason": "length" if reason == "length" else "stop",
            "total_duration": now - self.started,
            "load_duration": self.load_ns,
            "prompt_eval_count": self.job.prompt_tokens,
            "prompt_eval_duration": first - self.started,
            "eval_count": self.job.completion_tokens,
            "eval_duration": now - first,
        }


async def _whole(reply: _Reply) -> web.Response:
    whole, job, finish = Whole(), reply.job, None
    async with whole_answer(job):
        async for _, chunk in job.events():
            if (piece := reply.take(chunk)) is not None:
                whole.add(piece)
            finish = chunk.finish_reason or finish
    large = bool(reply.outputs) and reply.outputs[0].chars > LARGE_CALL_CHARS
    rest, finish = await off_loop_if(large, reply.finish, finish)
    whole.add(rest)
    await finish_or_503(job, 200, finish)
    piece = Piece(whole.thought(), whole.text())
    if reply.calls.calls:  # the space around a call is not an answer
        piece.content = piece.content.strip()
    return json_response(reply.done(finish, piece), headers=job.headers())


async def _stream(request: web.Request, reply: _Reply) -> web.StreamResponse:
    job = reply.job
    resp = web.StreamResponse(headers=NDJSON | job.headers())
    finish: str | None = None

    async def produce() -> str | None:
        nonlocal finish
        async for _, chunk in job.events():
            piece = reply.feed(chunk)
            if chunk.finish_reason:
                rest, finish = reply.finish(chunk.finish_reason)
                piece.extend(rest)
            if piece.content or piece.reasoning:
                await resp.write(_line(reply.said(piece)))
        if reply.calls.calls:
            await resp.write(_line(reply.said(Piece(), calls=True)))
        return finish

    if await streamed(request, resp, job, produce, _error_line):
        await resp.write(_line(reply.done(finish)))
        await resp.write_eof()
    return resp


def _ollama_calls(calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """OpenAI's calls in Ollama's shape, the arguments an object; a call whose arguments
    are not a JSON object cannot be one, so it stays text (returned apart)."""
    shaped, text = [], ""
    for call in calls:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            text += fn["arguments"]
            continue
        shaped.append(
            {"function": {"index": len(shaped), "name": fn["name"], "arguments": arguments}}
        )
    return shaped, text


def _empty(field: str) -> Any:
    return {"role": "assistant", "content": ""} if field == "message" else ""


def _loaded(model: str, said: dict[str, Any], unload: bool) -> web.Response:
    """The answer to Ollama's way of loading a model (no prompt, no messages), or, with
    keep_alive 0, of unloading it: done (the hold loaded it, and unloads it on leaving);
    nothing is generated or billed."""
    reason = "unload" if unload else "load"
    done = {"model": model, "created_at": _now(), **said, "done": True, "done_reason": reason}
    return json_response(done)


def _card(gw: GatewayState, principal: Principal, model: str) -> ModelCard:
    """The model's card; Ollama's 404 for one this tenant cannot see."""
    try:
        return model_card(gw, principal, served_name(model))
    except ApiError as e:
        if e.status == 404:
            raise ApiError(404, f"model '{model}' not found") from None
        raise


def _check_context(card: ModelCard, num_ctx: int | None) -> None:
    if num_ctx is not None and num_ctx > card.context_length:
        raise ApiError(
            400,
            f"options.num_ctx {num_ctx} is larger than the model's context of "
            f"{card.context_length} tokens",
        )


async def _described(gw: GatewayState, principal: Principal) -> list[Any]:
    cards = [c for c in gw.router.cards.values() if principal.may_use(c.id)]
    return [await describe(gw, c) for c in cards]


def _line(obj: dict[str, Any]) -> bytes:
    return json_bytes(obj) + b"\n"


def _error_line(error: ApiError, usage_lost: bool) -> bytes:
    return _line({"error": error.message})


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_post("/api/embed", embed_many)
    app.router.add_post("/api/embeddings", embed_one)
    ollama_manage.add_routes(app)
