"""One streaming request to an OpenAI-compatible server, timed the way vLLM's benchmark does.

TTFT is the time to the first chunk that carries generated text; each later text
chunk adds one inter-chunk gap to `itl`; the request ends at its last text chunk.
A reply with no text (the model stopped at once, or said only special tokens) is a
success like any other, as in vLLM's client: it is timed by its chunks that carry a
choice (one per token, as kvgate streams them). Only a transport error, a status
other than 200, an error event or a stream cut before the reply ended fail a request.
Token counts come only from the server's final `usage` chunk
(`stream_options.include_usage`); a server that sends none leaves them None.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestOutput:
    success: bool = False
    start_time: float = 0.0  # perf_counter seconds, when the request was sent
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # start to the last text chunk
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    generated_text: str = ""
    finish_reason: str | None = None  # the first choice's, as the stream last gave it
    error: str = ""
    tenant: int = 0


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The `data:` payloads of a Server-Sent Events stream, in order; comments skipped."""
    buffer = b""
    async for chunk in response.content.iter_any():
        # Events end at a blank line; a chunk may hold several events or part of one.
        buffer = (buffer + chunk).replace(b"\r\n", b"\n")
        while (cut := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:cut], buffer[cut + 2 :]
            data = [
                line[5:].removeprefix(" ")
                for line in event.decode("utf-8").split("\n")
                if line.startswith("data:")
            ]
            if data:
                yield "\n".join(data)
    tail = buffer.decode("utf-8").strip()
    if tail.startswith("data:"):
        yield tail[5:].removeprefix(" ")


def chunk_text(data: dict, endpoint: str) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def build_payload(
    endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool
) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM and kvgate extension: fixed output lengths
    return payload


# what aiohttp raises when it reuses a kept-alive connection the server has closed: the
# request never reached the server, so sending it again on a new connection is safe
_STALE_CONNECTION = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)


async def _post(
    stack: contextlib.AsyncExitStack,
    session: aiohttp.ClientSession,
    url: str,
    payload: dict,
    headers: dict[str, str],
) -> aiohttp.ClientResponse:
    """POST; if the pooled connection turns out closed before any response came, once
    more on a new connection of its own (llama-server closes connections after a stream
    and after 5 s idle, and the pool's other connections may be as stale). A second
    failure is the server's and counts."""
    try:
        return await stack.enter_async_context(session.post(url, json=payload, headers=headers))
    except _STALE_CONNECTION:
        connector = aiohttp.TCPConnector(force_close=True)
        fresh = aiohttp.ClientSession(connector=connector, timeout=session.timeout)
        await stack.enter_async_context(fresh)
        return await stack.enter_async_context(fresh.post(url, json=payload, headers=headers))


@dataclass
class _Timeline:
    """When a stream's chunks came: those with text time the reply; a reply without
    text is timed by its chunks that carry a choice, else by when the stream ended."""

    text_times: list[float] = field(default_factory=list)
    choice_times: list[float] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    end: float = 0.0
    done: bool = False  # [DONE] came

    def add(self, data: dict, endpoint: str, out: RequestOutput) -> None:
        choices = data.get("choices") or []
        if choices:
            self.choice_times.append(self.end)
            if reason := choices[0].get("finish_reason"):
                out.finish_reason = reason
        if text := chunk_text(data, endpoint):
            self.text_times.append(self.end)
            self.text_parts.append(text)
        if usage := data.get("usage"):
            out.prompt_tokens = usage.get("prompt_tokens")
            out.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = details.get("cached_tokens")

    def finish(self, out: RequestOutput) -> None:
        times = self.text_times or self.choice_times or [self.end]
        out.ttft = times[0] - out.start_time
        out.latency = times[-1] - out.start_time
        out.itl = [b - a for a, b in itertools.pairwise(self.text_times)]
        out.generated_text = "".join(self.text_parts)
        out.success = True


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    endpoint: str,
    payload: dict,
    api_key: str | None,
    tenant: int = 0,
) -> RequestOutput:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = RequestOutput(tenant=tenant)
    out.start_time = time.perf_counter()
    timeline = _Timeline()
    try:
        async with contextlib.AsyncExitStack() as stack:
            response = await _post(stack, session, base_url + path, payload, headers)
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return out
            async for event in sse_events(response):
                timeline.end = time.perf_counter()
                if event == "[DONE]":
                    timeline.done = True
                    break
                data = json.loads(event)
                if data.get("error"):
                    out.error = f"stream error: {json.dumps(data['error'])[:300]}"
                    return out
                timeline.add(data, endpoint, out)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if not timeline.done and out.finish_reason is None:
        out.error = "the stream ended before the reply did (no finish_reason, no [DONE])"
        return out
    timeline.finish(out)
    return out
