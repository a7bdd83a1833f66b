"""A Job's output in Anthropic's Messages shapes: the whole message, and the events of a
streamed one (content blocks opened, filled by text or JSON deltas, closed), with the
pings that keep a client waiting on a long prefill.

The chat-completions machinery does the work (gateway.serving.tool_calls reads the tool
calls out of the reply); this only reshapes it: OpenAI's tool calls are tool_use
blocks, its finish reasons Anthropic's stop reasons, and its usage Anthropic's, where
input_tokens leaves out the tokens read from the prefix cache.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from gateway.serving.job import Job
from gateway.serving.tool_calls import ToolCallStream, ToolPlan

PING_EVERY_S = 10.0  # a ping while no output comes, as Anthropic's API sends them
T = TypeVar("T")
Event = tuple[str, dict[str, Any]]  # (the SSE event name, its data)


def usage(job: Job) -> dict[str, int]:
    """Anthropic's usage: input_tokens counts the prompt's tokens not read from cache."""
    cached = job.cached_tokens
    return {
        "input_tokens": job.prompt_tokens - cached,
        "output_tokens": job.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


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


def reply_content(plan: ToolPlan, text: str) -> tuple[list[dict[str, Any]], bool]:
    """The whole reply's content blocks, and whether it made tool calls. A forced call
    cut short (max_tokens) is not JSON: its text is a text block."""
    content, calls = plan.parse(text)
    blocks = [tool_use(c) for c in calls[: None if plan.parallel else 1]]
    if any(b is None for b in blocks):
        content, blocks = text, []
    text_blocks = [{"type": "text", "text": content}] if content else []
    return text_blocks + [b for b in blocks if b is not None], bool(blocks)


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
    """One streamed reply as Anthropic's content block events: text streams as it comes
    into a text block; a named (forced) tool call's JSON streams into its tool_use block;
    other calls come whole at the end, as ToolCallStream gives them. Without parallel
    calls (disable_parallel_tool_use), a free reply's calls after its first are dropped
    (a forced one's schema allows one only)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.tools = ToolCallStream(plan)
        self.calls_left = None if plan.parallel else 1  # None: any number
        self.index = -1
        self.open: str | None = None  # the kind of the block being filled

    def feed(self, text: str) -> list[Event]:
        content, calls = self.tools.feed(text)
        return self._events(content, calls)

    def finish(self, reason: str | None) -> tuple[list[Event], str | None]:
        """The last events, and the finish reason ("tool_calls" where calls were made)."""
        content, calls, finish = self.tools.finish(reason)
        events = self._events(content, calls) + self._close()
        return events, finish

    def _events(self, text: str, calls: list[dict[str, Any]]) -> list[Event]:
        events = []
        if text:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""}, "text")
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in calls:
            arguments = call["function"].get("arguments", "")
            if "id" in call:  # a new call
                if self.calls_left == 0:
                    continue
                if self.calls_left is not None:
                    self.calls_left -= 1
                block = {"type": "tool_use", "id": _tool_use_id(call)}
                block |= {"name": call["function"]["name"], "input": {}}
                events += self._start(block, "tool_use")
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _start(self, block: dict[str, Any], kind: str) -> list[Event]:
        events = self._close()
        self.index += 1
        self.open = kind
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
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


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
