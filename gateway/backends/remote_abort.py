"""A request to a `kvgate worker` that its caller leaves (a client that hung up, a drain's
cut): the worker stops it and says what its engine computed, before the connection closes.

The gateway bills a request cut short by the prompt its engine computed (an embedding
request by the inputs it pooled), and only the worker knows that, the step in flight when
the client left included (an engine step completes, and its blocks stay cached). Closing
the connection aborts the request there but tells nothing back. So the request is opened
apart from the caller's task, and a caller that leaves first asks the worker to stop it
(`POST /kvgate/v1/abort`, gateway/worker/running.py), which answers once its engine applied
the abort; only then does the connection close. Where the worker cannot answer (it is
gone, the request already ended) the caller's Progress stays as it was.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from engine_api.errors import BackendError
from engine_api.records import Progress
from gateway.backends.remote_http import UpstreamClient

log = logging.getLogger("kvgate.remote")
ABORT_PATH = "/kvgate/v1/abort"
# how the gateway names an embedding request to a worker (a generation's id is in its body)
REQUEST_ID_HEADER = "X-Kvgate-Request-Id"


async def opened(
    client: UpstreamClient,
    url: str,
    body: Any,
    request_id: str,
    progress: Progress | None,
    **options: Any,
) -> aiohttp.ClientResponse:
    """`client.request("POST", url, body, **options)`, which a caller cancelled while it
    waits does not close before the worker stopped the request (when `progress` is given:
    what it computed goes there)."""
    opening = asyncio.ensure_future(client.request("POST", url, body, **options))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        if progress is not None:
            await stop_and_count(client, request_id, progress)
        opening.add_done_callback(_close_response)
        opening.cancel()
        raise


def _close_response(opening: asyncio.Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


async def stop_and_count(client: UpstreamClient, request_id: str, progress: Progress) -> None:
    """Have the worker stop `request_id` and take what its engine computed of it into
    `progress`, within the connect and read timeouts."""
    url = client.endpoint.root + ABORT_PATH
    timeout_s = client.connect_timeout_s + client.read_timeout_s
    try:
        data = await client.json("POST", url, {"request_id": request_id}, timeout_s=timeout_s)
    except BackendError as e:  # the request ended there, or the worker is gone: it said
        log.info("%s: request %s not stopped by its worker: %s", client.label, request_id, e)
        return
    counts = data if isinstance(data, dict) else {}
    tokens, cached = counts.get("prompt_tokens"), counts.get("cached_tokens")
    if _is_count(tokens) and _is_count(cached) and cached <= tokens:
        progress.advance(tokens, cached)  # the Job holds it to the prompt's length
    else:
        log.warning("%s: an invalid abort answer %r", client.label, str(data)[:200])


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31
