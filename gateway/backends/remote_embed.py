"""Embeddings through a remote upstream's OpenAI `/v1/embeddings`: a `kvgate worker`
serving an embedding model, or a third-party server (vLLM, llama.cpp's llama-server with
--embedding, llama-cpp-python's server with embedding on).

A remote entry serves an embedding model when its options say `task = "embed"` (the
upstream's model list does not say so in any common way). The gateway has rendered and
counted the inputs already; a worker is sent those token ids (the ones its own
/tokenize gave), a third-party server the texts as the client sent them where it sent
text (llama-cpp-python's server takes no token ids), else the ids.

The answer is not trusted any more than a completion's: it is read bounded
(max_response_bytes), parsed off the event loop when large, and must hold one vector of
finite numbers per input, all of one size, each index once; anything else is the
upstream's failure (503), never a partial answer. Its `usage.prompt_tokens` is a claim
the gateway checks against its own count (gateway.serving.embedding); where it is
missing the gateway's count stands.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from engine_api.errors import BackendError
from engine_api.records import EMBED, GENERATE, EmbedRequest, EmbedResult, Progress
from gateway.backends.remote_abort import REQUEST_ID_HEADER, opened
from gateway.backends.remote_http import UpstreamClient

LARGE_ANSWER_BYTES = 1 << 20  # an answer past this is parsed in a worker thread
TASKS = (GENERATE, EMBED)


def task_option(name: str, task: str | None) -> str:
    """A remote entry's `options.task` (default generate), or ValueError naming it."""
    if task is None:
        return GENERATE
    if task not in TASKS:
        raise ValueError(
            f"remote backend {name!r}: task must be one of {list(TASKS)}, got {task!r}"
        )
    return task


async def embed_upstream(
    client: UpstreamClient,
    req: EmbedRequest,
    worker: bool,
    timeout_s: float,
    progress: Progress | None = None,
) -> EmbedResult:
    """The upstream's vectors for `req` (its model already the upstream's id), within
    `timeout_s` in all; BadRequestError for an upstream's 400 (a worker's words relayed),
    BackendError for any other failure or an answer that does not fit. `progress`: the
    tokens of the inputs pooled; a worker's count when the caller leaves first (it names
    the request to the worker, remote_abort.py), else all of them once the answer came."""
    body: dict[str, Any] = {"model": req.model, "encoding_format": "float"}
    body["input"] = req.texts if req.texts is not None and not worker else req.inputs
    if req.dimensions is not None:
        body["dimensions"] = req.dimensions
    url = client.endpoint.base + "/embeddings"
    headers = {REQUEST_ID_HEADER: req.request_id} if worker else None
    resp = await opened(
        client,
        url,
        body,
        req.request_id,
        progress if worker else None,
        timeout_s=timeout_s,
        headers=headers,
    )
    async with resp:
        if resp.status >= 300:
            await client.raise_for(resp, relay=worker)
        if progress is not None:  # the whole answer is on its way: all of it was pooled
            progress.advance(sum(len(ids) for ids in req.inputs))
        raw = await client.read(resp, client.max_response_bytes)
    if len(raw) > LARGE_ANSWER_BYTES:
        return await asyncio.to_thread(parse_answer, raw, len(req.inputs), client.label)
    return parse_answer(raw, len(req.inputs), client.label)


def parse_answer(raw: bytes, inputs: int, label: str) -> EmbedResult:
    """An OpenAI embeddings answer for `inputs` inputs, checked whole; its
    prompt_tokens 0 where it sent none (the gateway's count then stands)."""
    try:
        answer = json.loads(raw)
    except ValueError:
        raise BackendError(f"{label} answered invalid JSON") from None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) != inputs:
        raise BackendError(f"{label} answered {_count(data)} embeddings for {inputs} inputs")
    vectors: list[list[float] | None] = [None] * inputs
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not _is_int(index) or not 0 <= index < inputs or vectors[index] is not None:
            raise BackendError(f"{label} answered embeddings with wrong indices")
        if not isinstance(vector, list) or not vector or not all(map(_is_finite, vector)):
            raise BackendError(f"{label} answered an embedding that is not a list of numbers")
        vectors[index] = [float(x) for x in vector]
    if len({len(v) for v in vectors if v is not None}) != 1:
        raise BackendError(f"{label} answered embeddings of different sizes")
    usage = answer.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return EmbedResult([v for v in vectors if v is not None], tokens if _is_int(tokens) else 0)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _count(data: Any) -> str:
    return str(len(data)) if isinstance(data, list) else "no"
