"""Third-party OpenAI-compatible upstreams (llama-cpp-python's server, llama.cpp's
llama-server, vLLM, SGLang): the streamed /v1/completions request they take, and their
server-sent events as GenChunks.

They differ where the OpenAI API is silent, so the request is the common ground:
sampling fields by vLLM's names plus llama.cpp's `repeat_penalty` where it matters
(each ignores the other's), every sampler set explicitly (llama.cpp's servers default
to top_k 40 and min_p 0.05, not OpenAI's plain sampling), the prompt as token ids, and
as text where the upstream refuses ids (llama-cpp-python), learned from its first
refusal. Usage comes from the upstream's usage chunk (`stream_options.include_usage`)
as a claim: the gateway's meter (gateway.serving.metering) counts the text delivered and takes
the claim only where it agrees; an upstream that sends none (llama-cpp-python again) has
its completion counted by the gateway, and the usage row says so.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from engine_api.errors import BackendError, BadRequestError
from engine_api.records import GenChunk, GenRequest, TokenLogprob, Usage
from gateway.backends.base import ParsedChunk
from gateway.backends.remote_http import (
    MAX_LINE_BYTES,
    UpstreamClient,
    parse_json_line,
    stream_error,
)
from gateway.backends.remote_parsed import upstream_parse
from gateway.backends.remote_text import carried, chat_body

log = logging.getLogger("kvgate.remote")


def completion_body(req: GenRequest, model: str, prompt: list[int] | str) -> dict[str, Any]:
    sp = req.sampling
    if sp.structured is not None:
        raise BadRequestError(unconstrained_upstream(req.model))
    if sp.prompt_logprobs is not None:  # their echo formats differ; vLLM's field is its own
        raise BadRequestError(
            "prompt logprobs (echo with logprobs) are not supported on the third-party "
            f"upstream of model {req.model!r}"
        )
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        # "off" is -1 for vLLM, SGLang and llama-server; llama-cpp-python (the server that
        # takes only text) refuses negatives and reads 0 as off
        "top_k": sp.top_k if sp.top_k > 0 else (0 if isinstance(prompt, str) else -1),
        "min_p": sp.min_p,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
    }
    if isinstance(prompt, str) or sp.repetition_penalty != 1.0:
        # llama.cpp's name; llama-cpp-python defaults to 1.1 (vLLM warns of the field)
        body["repeat_penalty"] = sp.repetition_penalty
    optional = {
        "seed": sp.seed,
        "stop": sp.stop or None,
        "stop_token_ids": sp.stop_token_ids or None,
        "min_tokens": sp.min_tokens or None,
        "ignore_eos": sp.ignore_eos or None,
        "skip_special_tokens": None if sp.skip_special_tokens else False,  # vLLM's
        "logprobs": sp.logprobs,
        "logit_bias": {str(t): b for t, b in sp.logit_bias} or None,
        # vLLM's: keeps the tenant's cached prefix apart from others' there too
        "cache_salt": req.cache_salt,
    }
    return body | {k: v for k, v in optional.items() if v is not None}


def unconstrained_upstream(model: str) -> str:
    """Why a third-party upstream gets no structured output: their fields for it differ
    (vLLM's structured_outputs, llama.cpp's json_schema and grammar), and one that
    ignored the field would answer unconstrained."""
    return (
        "structured outputs (response_format, guided_*, forced tool calls) are not "
        f"supported on the third-party upstream of model {model!r}"
    )


async def open_completion(
    client: UpstreamClient,
    req: GenRequest,
    model: str,
    takes_ids: bool | None,
    prompt_text: Callable[[list[int]], str] | None,
) -> tuple[aiohttp.ClientResponse, bool]:
    """The 200 response of POST /completions and whether the prompt went as ids.
    `takes_ids` None: not known yet, so ids first and, if the upstream refuses them,
    text (`prompt_text` turns ids back into the text they were rendered from)."""
    url = client.endpoint.base + "/completions"
    if takes_ids is None and prompt_text is not None:
        resp = await client.request("POST", url, completion_body(req, model, req.prompt_token_ids))
        if resp.status == 200:
            return resp, True
        log.info("%s: HTTP %d for a token-id prompt; trying text", client.label, resp.status)
        resp.close()
        takes_ids = False
    as_ids = takes_ids is not False or prompt_text is None
    prompt = req.prompt_token_ids if as_ids else prompt_text(req.prompt_token_ids)
    resp = await client.post_ok(url, completion_body(req, model, prompt))
    return resp, as_ids


async def open_text_completion(
    client: UpstreamClient, req: GenRequest, model: str
) -> aiohttp.ClientResponse:
    """The 200 response of the streamed request for a text-bound prompt: a string to
    /completions, a chat to /chat/completions (the upstream applies its own template)."""
    prompt, kwargs = carried(req.prompt_token_ids)
    body = completion_body(req, model, prompt if isinstance(prompt, str) else "")
    url = client.endpoint.base + "/completions"
    if not isinstance(prompt, str):
        body, url = chat_body(body, prompt, kwargs), client.endpoint.base + "/chat/completions"
    return await client.post_ok(url, body)


async def completion_chunks(
    client: UpstreamClient, resp: aiohttp.ClientResponse, top: int
) -> AsyncIterator[GenChunk]:
    """GenChunks of a completions SSE stream: text (no token ids) as it comes, then a
    last chunk with finish_reason and the upstream's usage, if it sent one; at most
    `top` alternatives a token are read. A stream that breaks raises BackendError; what
    it delivered before is counted by the meter. vLLM names the stop string that ended
    it (its choice's `stop_reason`): the last chunk carries it."""
    finish: str | None = None
    stop: str | None = None
    usage: Usage | None = None
    done = False
    try:
        async for data in _sse_data(client.lines(resp), client.label):
            if done or data == "[DONE]":  # read on to the end: the connection is reused
                done = True
                continue
            obj = parse_json_line(data, client.label)
            if (error := stream_error(obj, client.label)) is not None:
                raise error
            usage = _usage(obj.get("usage")) or usage
            for choice in obj.get("choices") or []:  # n = 1: at most one
                text, logprobs, reason = _choice(choice, client.label, top)
                reasoning, calls = upstream_parse(choice)
                if reasoning or calls:
                    yield ParsedChunk([], text, None, None, logprobs, None, None, reasoning, calls)
                elif text or logprobs:
                    yield GenChunk([], text, None, None, logprobs)
                finish = reason or finish
                if isinstance(choice, dict) and isinstance(choice.get("stop_reason"), str):
                    stop = choice["stop_reason"]
        if finish is None:
            raise BackendError(f"{client.label} ended the stream before the request finished")
    finally:
        if done:
            resp.release()
        else:
            resp.close()  # the upstream sees the connection close and stops generating
    yield GenChunk([], "", finish, usage, stop_sequence=stop if finish == "stop" else None)


async def _sse_data(lines: AsyncIterator[bytes], label: str) -> AsyncIterator[str]:
    """The data of each server-sent event (its data lines joined, at most a line's
    bound in all); comments, other fields and keep-alive pings are skipped."""
    data: list[str] = []
    size = 0
    async for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            size += len(line)
            if size > MAX_LINE_BYTES:
                raise BackendError(f"{label} sent an event over {MAX_LINE_BYTES} bytes")
        elif not line and data:
            yield "\n".join(data).strip()
            data, size = [], 0
    if data:
        yield "\n".join(data).strip()


def _choice(choice: Any, label: str, top: int) -> tuple[str, list[TokenLogprob] | None, str | None]:
    """A completion's choice, or a chat completion's (its delta's content; its
    logprobs' `content` list read as the completions' parallel lists)."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    text = choice.get("text") if isinstance(choice, dict) else None
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    if isinstance(delta, dict):
        text = delta.get("content")
        logprobs = _chat_logprobs(logprobs)
    if not isinstance(choice, dict) or not isinstance(text or "", str):
        raise BackendError(f"{label} sent an invalid completion choice")
    reason = choice.get("finish_reason")
    if reason is not None:
        reason = "length" if reason == "length" else "stop"  # eos, stop string, stop id
    return text or "", _logprobs(logprobs, top), reason


def _chat_logprobs(data: Any) -> dict[str, list] | None:
    """The chat API's logprobs ({"content": [{token, logprob, top_logprobs}]}) in the
    completions API's shape."""
    items = data.get("content") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None
    items = [i for i in items if isinstance(i, dict)]
    tops = [i.get("top_logprobs") if isinstance(i.get("top_logprobs"), list) else [] for i in items]
    return {
        "tokens": [i.get("token") for i in items],
        "token_logprobs": [i.get("logprob") for i in items],
        "top_logprobs": [
            {t["token"]: t.get("logprob") for t in top if isinstance(t, dict) and _str(t)}
            for top in tops
        ],
    }


def _usage(data: Any) -> Usage | None:
    if not isinstance(data, dict):
        return None
    prompt, completion = data.get("prompt_tokens"), data.get("completion_tokens")
    details = data.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    cached, images = details.get("cached_tokens", 0), details.get("image_tokens", 0)
    if not all(_count(n) for n in (prompt, completion)):
        return None
    # image_tokens: where the upstream says (a kvgate gateway does; vLLM does not)
    cached, images = (n if _count(n) else 0 for n in (cached, images))
    return Usage(prompt, completion, cached, image_tokens=images)


def _str(entry: dict) -> bool:
    return isinstance(entry.get("token"), str)


def _count(n: Any) -> bool:
    """A token count as JSON may give it: an integer, not a bool; its range is the
    meter's to judge (gateway.serving.metering), within a bound that keeps it a machine word."""
    return isinstance(n, int) and not isinstance(n, bool) and -(2**62) < n < 2**62


def _logprobs(data: Any, top: int) -> list[TokenLogprob] | None:
    """The legacy completions logprobs object ({tokens, token_logprobs, top_logprobs}),
    with at most `top` alternatives a token (an upstream may send thousands)."""
    if not isinstance(data, dict):
        return None
    tokens, values = data.get("tokens"), data.get("token_logprobs")
    tops = data.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    tops = tops if isinstance(tops, list) else []
    out = []
    for i, (token, value) in enumerate(zip(tokens, values, strict=False)):
        if not isinstance(token, str) or not _logprob(value):
            continue
        alternatives = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        valid = ((t, float(v)) for t, v in alternatives.items() if _logprob(v))
        pairs = list(itertools.islice(valid, top))
        out.append(TokenLogprob(token, float(value), pairs))
    return out or None


def _logprob(v: Any) -> bool:
    """A number a logprob can be (JSON's NaN and Infinity, as Python reads them, are not)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
