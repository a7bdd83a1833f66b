"""A Job's output in Anthropic's Messages shapes: the whole message, and the events of a
streamed one (content blocks opened, filled by text or JSON deltas, closed), with the
pings that keep a client waiting on a long prefill.

The chat-completions machinery does the work (gateway.serving.parsed_output reads the
reasoning and tool calls out of the reply); this only reshapes it: reasoning is a
thinking block, OpenAI's tool calls are tool_use blocks, its finish reasons Anthropic's
stop reasons, and its usage Anthropic's, where input_tokens leaves out the tokens read
from the prefix cache.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from gateway.backends import GenChunk
from gateway.serving.job import Job
from gateway.serving.parsed_output import ChoiceOutput, Piece, Whole

PING_EVERY_S = 10.0  # a ping while no output comes, as Anthropic's API sends them
T = TypeVar("T")
Event = tuple[str, dict[str, Any]]  # (the SSE event name, its data)


def usage(job: Job) -> dict[str, int]:
    """Anthropic's usage: input_tokens counts the prompt's tokens not read from cache;
    kvgate's image_tokens (of the prompt's tokens, its images') only where there were
    images (a field the SDK keeps and other clients ignore)."""
    cached = job.cached_tokens
    out = {
        "input_tokens": job.prompt_tokens - cached,
        "output_tokens": job.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }
    if images := job.image_tokens:
        out["image_tokens"] = images
    return out


def message(
    job: Job, content: list[dict[str, Any]], stop: tuple[str | None, str | None]
) -> dict[str, Any]:
    """The message object; `stop` is its (stop_reason, stop_sequence)."""
    return {
        "id": job.request_id,
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage(job),
    }


def stop_of(job: Job, finish: str | None, stop_sequence: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a reply that ended with OpenAI's `finish`; a stop
    string counts only if it is one the request gave (an upstream's word is not taken)."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and stop_sequence in job.requests[0].sampling.stop:
        return "stop_sequence", stop_sequence
    return "end_turn", None


def reply_content(whole: Whole) -> tuple[list[dict[str, Any]], bool]:
    """The whole reply's content blocks (its thinking first), and whether it made tool
    calls. A call whose arguments are no JSON object (a forced one cut short by
    max_tokens) is text: its arguments, after any content."""
    thought, text, calls = whole.thought(), whole.text(), whole.tool_calls()
    blocks = [tool_use(c) for c in calls]
    if any(b is None for b in blocks):
        text, blocks = text + "".join(c["function"]["arguments"] for c in calls), []
    elif blocks:  # the space around a call is not an answer
        text = text.strip()
    head = [thinking_block(thought)] if thought else []
    text_blocks = [{"type": "text", "text": text}] if text else []
    return head + text_blocks + [b for b in blocks if b is not None], bool(blocks)


def thinking_block(thought: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thought, "signature": _signature(thought)}


def _signature(thought: str) -> str:
    """A thinking block's `signature`: Anthropic's verifies the block came from its model;
    kvgate's is the digest of the text (it checks none it is sent back)."""
    return base64.b64encode(hashlib.sha256(thought.encode()).digest()).decode()


def tool_use(call: dict[str, Any]) -> dict[str, Any] | None:
    """An OpenAI tool call as a tool_use block; None if its arguments are no JSON object."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    name = call["function"]["name"]
    return {"type": "tool_use", "id": _tool_use_id(call), "name": name, "input": arguments}


def _tool_use_id(call: dict[str, Any]) -> str:
    return "toolu_" + call["id"].removeprefix("call_")


class MessageEvents:
    """One streamed reply as Anthropic's content block events: reasoning streams into a
    thinking block (its signature_delta before it closes), text into a text block, each
    tool call's JSON into its tool_use block, as the choice's ChoiceOutput reads them
    (gateway.serving.parsed_output)."""

    def __init__(self, output: ChoiceOutput) -> None:
        self.output = output
        self.index = -1
        self.open: str | None = None  # the kind of the block being filled
        self.thought = hashlib.sha256()  # the open thinking block's text so far
        self.fed_chars = 0  # what the last events carry: a large lot is encoded off the loop

    def feed(self, chunk: GenChunk) -> list[Event]:
        return self._events(self.output.feed(chunk))

    def finish(self, reason: str | None) -> tuple[list[Event], str | None]:
        """The last events, and the finish reason ("tool_calls" where calls were made)."""
        piece, finish = self.output.finish(reason)
        return self._events(piece) + self._close(), finish

    def _events(self, piece: Piece) -> list[Event]:
        self.fed_chars = piece.chars()
        events = []
        if piece.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.thought = hashlib.sha256()
            self.thought.update(piece.reasoning.encode())
            events.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.content:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": piece.content}))
        for call in piece.calls:
            arguments = call["function"].get("arguments", "")
            if "id" in call:  # a new call
                block = {"type": "tool_use", "id": _tool_use_id(call)}
                events += self._start(block | {"name": call["function"]["name"], "input": {}})
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": self.index,
            "delta": delta,
        }

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            signature = base64.b64encode(self.thought.digest()).decode()
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
        self.open = None
        stop = {"type": "content_block_stop", "index": self.index}
        return [*events, ("content_block_stop", stop)]


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event, named as Anthropic names them."""
    body = json.dumps(data, separators=(",", ":"))
    return f"event: {name}\ndata: {body}\n\n".encode()


async def with_pings(items: AsyncIterator[T], every: float) -> AsyncIterator[T | None]:
    """`items`, and None each time `every` seconds pass without one. The wait for the next
    item is never cancelled by a ping (it runs on in its task): the job's generator is
    not interrupted mid-step; only a client that leaves cancels it, as it would anyway."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(_next(items))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            item, pending = pending, None
            try:
                value = item.result()
            except StopAsyncIteration:
                return
            yield value
    finally:
        if pending is not None:  # the consumer left (a client gone): so does the wait
            pending.cancel()
            await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()  # retrieved: no one is left to hear of it
        await items.aclose()  # type: ignore[attr-defined]


async def _next(items: AsyncIterator[T]) -> T:
    return await anext(items)
