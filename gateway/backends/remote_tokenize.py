"""The tokenizer endpoints of an upstream, called for the gateway: a prompt or chat
rendered into token ids (vLLM's /tokenize, which a kvgate worker serves too, or
llama-server's /apply-template and /tokenize), and generated text counted (those, or
llama-cpp-python's /extras/tokenize). Which an upstream has is discovered
(remote_discovery.py); the request and answer shapes of each live here, so the adapter
(remote.py) asks one function whatever the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from engine_api.errors import BackendError, BadRequestError
from gateway.backends.remote_discovery import LLAMA_CPP_PYTHON, LLAMA_SERVER
from gateway.backends.remote_http import UpstreamClient
from gateway.backends.remote_images import json_body, outgoing
from gateway.backends.tool_prompt import plain_tool_turns

log = logging.getLogger("kvgate.remote")
LARGE_COUNT_CHARS = 1 << 20  # output text to count past this is encoded in a thread


async def tokenize(
    client: UpstreamClient,
    kind: str,
    model: str,
    prompt: str | list[dict[str, Any]],
    tools: list[dict] | None,
    relay: bool,
    kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids the upstream makes of a string or a chat (`relay`: a worker's 400
    is passed on in its words), the chat with its template's variables `kwargs` (vLLM's
    and llama-server's chat_template_kwargs) and its images (a worker's: remote_images)."""
    body: dict[str, Any] | bytes
    if kind == LLAMA_SERVER:
        body = await llama_server_tokenize_body(client, prompt, tools, kwargs)
    elif isinstance(prompt, str):
        body = {"model": model, "prompt": prompt}
    else:
        messages, images = outgoing(prompt)
        chat = {"model": model, "messages": messages, "add_generation_prompt": True}
        if tools:
            chat["tools"] = tools  # vLLM's /tokenize takes them, as a worker's does
        if kwargs:
            chat["chat_template_kwargs"] = kwargs
        body = await json_body(chat, images)
    data = await client.json("POST", client.endpoint.root + "/tokenize", body, relay=relay)
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise BackendError(f"{client.label} sent an invalid /tokenize answer")
    return tokens


async def llama_server_tokenize_body(
    client: UpstreamClient,
    prompt: str | list[dict[str, Any]],
    tools: list[dict] | None,
    kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The /tokenize body that makes llama-server's prompt of a string or a chat, as it
    tokenizes one itself (BOS added, special tokens parsed): a chat rendered by its
    /apply-template, with tools as the gateway's plain turns (its calls come back as
    <tool_call> blocks, whatever the server's template)."""
    text = prompt
    if not isinstance(text, str):
        messages = plain_tool_turns(prompt, tools) if tools else prompt
        url = client.endpoint.root + "/apply-template"
        ask: dict[str, Any] = {"messages": messages}
        if kwargs:
            ask["chat_template_kwargs"] = kwargs
        data = await client.json("POST", url, ask)
        text = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(text, str):
            raise BackendError(f"{client.label} sent an invalid /apply-template answer")
    return {"content": text, "add_special": True, "parse_special": True}


def count_request(kind: str, model: str, text: str) -> tuple[str, dict[str, Any]]:
    """The path and body that count `text` (no special tokens added, where the server
    lets one say so) on a tokenizer endpoint of `kind`."""
    if kind == LLAMA_SERVER:
        return "/tokenize", {"content": text, "add_special": False}
    if kind == LLAMA_CPP_PYTHON:
        return "/extras/tokenize", {"input": text, "model": model}
    return "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}


async def count(
    client: UpstreamClient, kind: str, model: str, text: str, overhead: int, timeout_s: float
) -> int | None:
    """Tokens in generated text on a tokenizer endpoint of `kind`, less the `overhead`
    it adds to any text; None where it cannot tell (logged)."""
    path, request = count_request(kind, model, text)
    body: Any = request
    if len(text) > LARGE_COUNT_CHARS:  # encoding megabytes of JSON would stall the loop
        body = (await asyncio.to_thread(json.dumps, request)).encode()
    try:
        data = await client.json("POST", client.endpoint.root + path, body, timeout_s=timeout_s)
    except (BackendError, BadRequestError) as e:
        log.info("%s: cannot count output tokens: %s", client.label, e)
        return None
    n = data.get("count") if isinstance(data, dict) else None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if isinstance(tokens, list):
        n = len(tokens)
    ok = isinstance(n, int) and not isinstance(n, bool)
    return max(n - overhead, 0) if ok else None


async def detokenize(
    client: UpstreamClient,
    model: str,
    token_ids: list[int],
    skip_special_tokens: bool,
    is_worker: bool,
) -> str:
    """The upstream's /detokenize (vLLM's shape, which a worker serves; only a worker
    takes skip_special_tokens)."""
    body: dict[str, Any] = {"model": model, "tokens": token_ids}
    if skip_special_tokens:
        body["skip_special_tokens"] = True
    data = await client.json("POST", client.endpoint.root + "/detokenize", body, relay=is_worker)
    # vLLM's and a worker's answer say `prompt`, llama-server's `content` (either may
    # be "": the text of a BOS alone)
    text = data.get("prompt", data.get("content")) if isinstance(data, dict) else None
    if not isinstance(text, str):
        raise BackendError(f"{client.label} sent an invalid /detokenize answer")
    return text
